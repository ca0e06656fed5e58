"""Rebuild an accepted op from its stored wire request, for recovery after a crash or restart.

The same prepare_* functions the routes use decode the body, so a replayed op is exactly the op
that was accepted; ops of kinds that cannot be rebuilt raise KeyError and fail with a clear note.
"""

from __future__ import annotations

from tinkerd.api.deps import AppState
from tinkerd.api.routes import export, sampling, training
from tinkerd.control.control import Work
from tinkerd.control.store.tables import FutureRow

PREPARERS = {**training.PREPARERS, **sampling.PREPARERS, **export.PREPARERS}


def make_rebuild(st: AppState):
    def rebuild(row: FutureRow) -> Work:
        # As the account that submitted it: ownership checks and billing are the original ones.
        prepare = PREPARERS[row.request_type]
        if row.status == "complete":
            # A completed op is part of its adapter's state: it is rebuilt as it ran, without the
            # input bounds (api/limits.py) and the non-finite guard added since, so a run accepted
            # before them (model_seq_id -1, an optim_step with eps=0) replays to the same state
            # instead of being dropped. Only state-changing ops are replayed (control/recovery.py).
            return prepare(st, row.body, row.account_id, completed=True).work
        # A pending op never ran: it is checked like a new request, and fails if it no longer passes.
        return prepare(st, row.body, row.account_id).work

    return rebuild
