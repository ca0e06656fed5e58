"""Sampling sessions and the samples recorded for stable_reinforce behind repositories
(control/sampling_sessions.py, inflight.py, residency.py, overview.py, costs.py and stability.py hold the rules;
the queries are here). Sampling sessions come out as frozen SamplingSession dataclasses, not rows."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import delete, func, or_, select, update

from tinkerd.control.store.db import Store
from tinkerd.control.store.repository import Keyed
from tinkerd.control.store.tables import RecordedSampleRow, SamplingSessionRow, SessionRow, UsageRow


@dataclass(frozen=True)
class SamplingSession:
    sampling_session_id: str  # `{session_id}:sample:{n}`
    session_id: str
    base_model: str
    model_path: str | None  # the tinker:// path the user named (None: base model, ephemeral, inflight)
    adapter_dir: str | None  # the adapter the engine loads (None: the base model alone)
    created_at: datetime
    clients_joined: int | None  # clients that joined it (join_sampling_session); None: none yet
    inflight_of: str | None  # an inflight sampler: the training run whose inflight target it follows


@dataclass(frozen=True)
class SamplerUse:
    """A sampling session and its metered sample requests (the console's sampling activity)."""

    session: SamplingSession
    requests: int
    prefill_tokens: int
    sampled_tokens: int
    last_at: datetime | None


class SamplingSessionRepository(Keyed[SamplingSession]):
    row, item = SamplingSessionRow, SamplingSession


    def ids_of_session(self, session_id: str) -> list[str]:
        """The session's sampling sessions, in the order they were created."""
        return self.store.query(select(SamplingSessionRow.sampling_session_id)
                                .where(SamplingSessionRow.session_id == session_id)
                                .order_by(SamplingSessionRow.created_at, SamplingSessionRow.sampling_session_id))

    def existing(self, sampling_session_ids) -> set[str]:
        """Those of the ids whose sampling session exists."""
        ids = list(sampling_session_ids)
        if not ids:
            return set()
        return set(self.store.query(select(SamplingSessionRow.sampling_session_id)
                                    .where(SamplingSessionRow.sampling_session_id.in_(ids))))

    def join(self, sampling_session_id: str) -> int:
        """Count one more joined client, in one write transaction (concurrent joiners never share a
        number); the new count."""
        with self.store.write() as s:
            row = s.get(SamplingSessionRow, sampling_session_id)
            row.clients_joined = (row.clients_joined or 0) + 1
            return row.clients_joined

    def ephemeral_of_session(self, session_id: str) -> list[SamplingSession]:
        """The session's samplers of unnamed weights (no model_path, an adapter, not inflight)."""
        return [self._item(r) for r in self.store.query(select(SamplingSessionRow).where(
            SamplingSessionRow.session_id == session_id, SamplingSessionRow.model_path.is_(None),
            SamplingSessionRow.adapter_dir.is_not(None), SamplingSessionRow.inflight_of.is_(None)))]

    def inflight_of(self, model_id: str) -> list[SamplingSession]:
        """The inflight samplers following a run's inflight target."""
        return [self._item(r) for r in
                self.store.query(select(SamplingSessionRow).where(SamplingSessionRow.inflight_of == model_id))]

    def repoint_inflight(self, model_id: str, adapter_dir: str) -> None:
        """Every inflight sampler of the run samples `adapter_dir` from now on (one statement)."""
        with self.store.write() as s:
            s.execute(update(SamplingSessionRow).where(SamplingSessionRow.inflight_of == model_id)
                      .values(adapter_dir=adapter_dir))

    def with_adapter(self, adapter_dirs: list[str] | None = None) -> list[SamplingSession]:
        """Sampling sessions that load an adapter (one of `adapter_dirs` when given)."""
        where = (SamplingSessionRow.adapter_dir.is_not(None) if adapter_dirs is None
                 else SamplingSessionRow.adapter_dir.in_(adapter_dirs))
        return [self._item(r) for r in self.store.query(select(SamplingSessionRow).where(where))]

    def runs_of_account(self, account_id: str) -> list[tuple[str, str | None, str | None]]:
        """(sampling_session_id, model_path, inflight_of) of the account's sampling sessions."""
        stmt = (select(SamplingSessionRow.sampling_session_id, SamplingSessionRow.model_path,
                       SamplingSessionRow.inflight_of)
                .join(SessionRow, SessionRow.session_id == SamplingSessionRow.session_id)
                .where(SessionRow.account_id == account_id))
        return [tuple(r) for r in self.store.rows(stmt)]

    def use_of_run(self, model_id: str, limit: int) -> list[SamplerUse]:
        """The samplers of a run's weights (a checkpoint of it, or its inflight target), newest first,
        with their metered sample requests and tokens."""
        of_run = or_(SamplingSessionRow.model_path.like(f"tinker://{_like_escape(model_id)}/%", escape="\\"),
                     SamplingSessionRow.inflight_of == model_id)
        stmt = (select(SamplingSessionRow, func.count(UsageRow.request_id), func.coalesce(func.sum(UsageRow.prefill_tokens), 0),
                       func.coalesce(func.sum(UsageRow.sampled_tokens), 0), func.max(UsageRow.completed_at))
                .outerjoin(UsageRow, UsageRow.target == SamplingSessionRow.sampling_session_id)
                .where(of_run)
                .group_by(SamplingSessionRow.sampling_session_id)
                .order_by(SamplingSessionRow.created_at.desc()).limit(limit))
        return [SamplerUse(self._item(r), int(n), int(pre), int(samp), last)
                for r, n, pre, samp, last in self.store.rows(stmt)]


class RecordedSampleRepository:
    def __init__(self, store: Store):
        self.store = store

    def get(self, request_id: str) -> RecordedSampleRow | None:
        return self.store.get(RecordedSampleRow, request_id)

    def put(self, row: RecordedSampleRow) -> None:
        """Insert, or replace a row of the same request (a re-run after a crash)."""
        with self.store.write() as s:
            s.merge(row)

    def clear_expired(self, now: datetime, forget_before: datetime) -> tuple[int, int]:
        """Clear the payloads of rows expired by `now` (leaving tombstones) and delete rows that
        expired before `forget_before`, in one transaction; both counts."""
        with self.store.write() as s:
            cleared = s.execute(
                update(RecordedSampleRow)
                .where(RecordedSampleRow.expires_at < now, RecordedSampleRow.tokens.is_not(None))
                .values(prompt=None, lengths=None, tokens=None, logprobs=None)).rowcount
            deleted = s.execute(delete(RecordedSampleRow).where(RecordedSampleRow.expires_at < forget_before)).rowcount
        return cleared, deleted

    def extend(self, request_ids: list[str], expires_at: datetime) -> None:
        with self.store.write() as s:
            s.execute(update(RecordedSampleRow).where(RecordedSampleRow.request_id.in_(request_ids))
                      .values(expires_at=expires_at))


def _like_escape(text: str) -> str:
    return text.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")
