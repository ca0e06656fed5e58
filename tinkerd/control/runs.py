"""The run registry: sessions, their training runs, the runs' checkpoints and the sessions' sampling
sessions, one class per noun (control/sessions.py, training_runs.py, checkpoints.py,
sampling_sessions.py) sharing one store, artifact store and audit log. `Runs` only builds and holds
them, so that the API and control take the four as one dependency; the rules are in each class.
Ids and the tinker:// path grammar are in control/ids.py.
"""

from __future__ import annotations

from tinkerd.artifacts import ArtifactStore
from tinkerd.control.audit import AuditLog
from tinkerd.control.checkpoints import Checkpoints
from tinkerd.control.sampling_sessions import SamplingSessions
from tinkerd.control.sessions import Sessions
from tinkerd.control.store.db import Store
from tinkerd.control.training_runs import TrainingRuns


class Runs:
    def __init__(self, store: Store, artifacts: ArtifactStore, audit: AuditLog | None = None):
        self.store = store
        self.artifacts = artifacts
        self.audit = audit or AuditLog(store)
        self.sessions = Sessions(store, self.audit)
        self.training_runs = TrainingRuns(store, self.sessions)
        self.checkpoints = Checkpoints(store, artifacts, self.sessions, self.audit)
        self.sampling_sessions = SamplingSessions(store, artifacts, self.sessions)
        self.storage = self.checkpoints.storage

    def refuse_under(self, reserve) -> None:
        """New sessions and samplers are new work, refused while free disk space is under the
        reserve (control/diskspace.py)."""
        self.sessions.reserve = reserve
        self.sampling_sessions.reserve = reserve
