"""Sampling sessions (`{session_id}:sample:{n}`): creating, joining and looking one up for its owner,
and pruning a session's ephemeral samplers (save_weights_and_get_sampling_client). A sampler is owned
through its session (control/sessions.py)."""

from __future__ import annotations

from typing import Callable

from tinkerd.artifacts import ArtifactStore, join, key_of_path
from tinkerd.control.ids import EPHEMERAL, parent_key
from tinkerd.control.sessions import Sessions
from tinkerd.control.store.db import Store, utcnow
from tinkerd.control.store.sampling import SamplingSession, SamplingSessionRepository


class SamplingSessions:
    def __init__(self, store: Store, artifacts: ArtifactStore, sessions: Sessions):
        self.store = store
        self.sessions = sessions
        self.samplers = SamplingSessionRepository(store)
        # Ephemeral samplers' weights, by key under EPHEMERAL (tinkerd/artifacts.py).
        self.artifacts = artifacts
        # The free-space reserve (control/diskspace.py): a new sampler is new work, refused under
        # it. None (tests) never refuses.
        self.reserve = None

    def create_sampling_session(self, session_id: str, seq_id: int, base_model: str, model_path: str | None,
                                adapter_dir: str | None, account_id: str | None = None,
                                accepted: bool = False, inflight_of: str | None = None) -> SamplingSession:
        """accepted=True: the sampler an accepted op made (save_weights_for_sampler's ephemeral one),
        which spends the free-space reserve; otherwise a new sampler is new work, refused under it
        (a re-send of one already made is not)."""
        self.sessions.owned_session(session_id, account_id)
        sid = f"{session_id}:sample:{seq_id}"
        if not accepted and self.reserve is not None and self.samplers.get(sid) is None:
            self.reserve.check()
        row = SamplingSession(sampling_session_id=sid, session_id=session_id, base_model=base_model,
                              model_path=model_path, adapter_dir=adapter_dir, created_at=utcnow(),
                              clients_joined=None, inflight_of=inflight_of)
        if not self.samplers.add(row):
            return self.sampling_session(sid)
        return row

    def sampling_session(self, sampling_session_id: str) -> SamplingSession:
        return self.sessions.lookup(self.samplers.get, sampling_session_id, "sampling_session_id")

    def owned_sampling_session(self, sampling_session_id: str, account_id: str | None) -> SamplingSession:
        return self.sessions.lookup(self.samplers.get, sampling_session_id, "sampling_session_id", account_id)

    def join_sampling_session(self, sampling_session_id: str, account_id: str | None) -> int:
        """A new client id of the sampling session, unique among its clients: 1, 2, ... (0 is the
        original client). Counted in one write transaction, so concurrent joiners never share one."""
        self.owned_sampling_session(sampling_session_id, account_id)
        return self.samplers.join(sampling_session_id)

    def ephemeral_key(self, sampling_session_id: str) -> str:
        """The artifact key of an ephemeral sampler's weights (save_weights_and_get_sampling_client)."""
        return join(EPHEMERAL, sampling_session_id)

    def prune_ephemeral_samplers(self, session_id: str, keep: int, busy: Callable[[str], bool]) -> list[str]:
        """Delete the session's ephemeral samplers (save_weights_and_get_sampling_client) older than
        its newest `keep`, except ones a queued or decoding request uses; returns the deleted ids.

        Run on the control worker after each new one, so `busy` is exact and no request is admitted
        meanwhile; one spared as busy goes at the next call. The row goes first: from then on a
        request for it is a 404 rather than a sample from missing files. (A request that read the
        row just before, and is not queued yet, fails at admission: the files are gone.) A decoding
        request holds its weights in memory, so deleting files under it is safe.
        """
        rows = self.samplers.ephemeral_of_session(session_id)
        ephemeral = [r for r in rows if parent_key(r.adapter_dir) == EPHEMERAL]
        # `<session>:sample:<n>`, n counting up in creation order (shared with named samplers).
        ephemeral.sort(key=lambda r: int(r.sampling_session_id.rsplit(":", 1)[-1]))
        deleted = []
        for row in ephemeral[: max(0, len(ephemeral) - keep)]:
            if busy(row.sampling_session_id):
                continue
            self.samplers.delete(row.sampling_session_id)
            self.artifacts.delete(key_of_path(row.adapter_dir))
            deleted.append(row.sampling_session_id)
        return deleted
