"""Reading sessions for the SDK's RestClient: list, get, search. One account's sessions only.

A session's status comes from what tinkerd records: `finished_reason` (the client's finish reason)
or none yet (active). tinkerd never cancels or fails a whole session, so those statuses match nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime

from sqlalchemy import func, or_, select

from tinkerd.control.runs import Runs
from tinkerd.control.store.db import utcnow
from tinkerd.control.store.tables import CheckpointRow, SamplingSessionRow, SessionRow, TrainingRunRow

CLIENT_REASONS = ("success", "errored", "interrupted")


@dataclass
class SessionSearch:
    session_id: str | None = None
    display_name: str | None = None
    user_metadata: dict = field(default_factory=dict)
    statuses: list[dict] | None = None  # SDK SessionStatusQuery dicts
    limit: int = 50
    after: tuple[datetime, str] | None = None  # the cursor: (created_at, session_id) of the last one
    project_ids: list[str] | None = None  # None: every project, and sessions in none


def status_of(row: SessionRow) -> dict:
    if row.finished_reason is None:
        return {"type": "active"}
    if row.finished_reason in CLIENT_REASONS:
        return {"type": "client_finished", "reason": {"type": row.finished_reason}}
    return None  # finished for a reason the SDK has no status for (tinkerd's own, or unknown)


def _matches_status(row: SessionRow, queries: list[dict] | None) -> bool:
    if queries is None:
        return True
    for q in queries:
        if q["type"] == "active" and row.finished_reason is None:
            return True
        if q["type"] == "client_finished" and row.finished_reason in (q.get("reasons") or CLIENT_REASONS):
            return True
    return False


def _matches_name(row: SessionRow, display_name: str) -> bool:
    name = (row.display_name or "").lower()
    return all(word in name for word in display_name.lower().split())


class Sessions:
    def __init__(self, runs: Runs):
        self.runs = runs
        self.store = runs.store

    def list(self, account_id: str, limit: int, offset: int) -> list[str]:
        stmt = (select(SessionRow.session_id).where(SessionRow.account_id == account_id)
                .order_by(SessionRow.created_at.desc(), SessionRow.session_id).limit(limit).offset(offset))
        return self.store.query(stmt)

    def get(self, session_id: str, account_id: str) -> tuple[SessionRow, list[str], list[str]]:
        row = self.runs.owned_session(session_id, account_id)
        runs = self.store.query(select(TrainingRunRow.model_id).where(TrainingRunRow.session_id == session_id)
                                .order_by(TrainingRunRow.created_at, TrainingRunRow.model_id))
        samplers = self.store.query(select(SamplingSessionRow.sampling_session_id)
                                    .where(SamplingSessionRow.session_id == session_id)
                                    .order_by(SamplingSessionRow.created_at, SamplingSessionRow.sampling_session_id))
        return row, runs, samplers

    def search(self, account_id: str, q: SessionSearch) -> tuple[list[SessionRow], bool]:
        """A page of the account's matching sessions, newest first, and whether more follow."""
        stmt = select(SessionRow).where(SessionRow.account_id == account_id)
        if q.project_ids is not None:
            stmt = stmt.where(SessionRow.project_id.in_(q.project_ids))
        if q.after is not None:
            at, sid = q.after
            stmt = stmt.where((SessionRow.created_at < at) | ((SessionRow.created_at == at) & (SessionRow.session_id > sid)))
        stmt = stmt.order_by(SessionRow.created_at.desc(), SessionRow.session_id)
        page: list[SessionRow] = []
        for row in self.store.query(stmt):
            named = q.session_id is not None or q.display_name is not None
            if named and not (row.session_id == q.session_id
                              or (q.display_name is not None and _matches_name(row, q.display_name))):
                continue
            meta = row.user_metadata or {}
            if any(str(meta.get(k)) != v or k not in meta for k, v in q.user_metadata.items()):
                continue
            if not _matches_status(row, q.statuses):
                continue
            if len(page) == q.limit:
                return page, True
            page.append(row)
        return page, False

    def checkpoint_totals(self, session_ids: list[str]) -> dict[str, tuple[int, int]]:
        """session_id -> (live checkpoint count, their bytes)."""
        if not session_ids:
            return {}
        # Live rows only, filtered rather than swept: removal is CheckpointSweeper's (control/runs.py).
        live = or_(CheckpointRow.expires_at.is_(None), CheckpointRow.expires_at > utcnow())
        stmt = (select(TrainingRunRow.session_id, func.count(CheckpointRow.tinker_path),
                       func.coalesce(func.sum(CheckpointRow.size_bytes), 0))
                .join(CheckpointRow, CheckpointRow.model_id == TrainingRunRow.model_id)
                .where(TrainingRunRow.session_id.in_(session_ids), live).group_by(TrainingRunRow.session_id))
        return {sid: (int(n), int(b)) for sid, n, b in self.store.rows(stmt)}

    def by_ids(self, session_ids: set[str]) -> list[SessionRow]:
        if not session_ids:
            return []
        return self.store.query(select(SessionRow).where(SessionRow.session_id.in_(session_ids)))

    def projects_of_runs(self, model_ids: set[str]) -> dict[str, str | None]:
        """model_id -> the project of its session now (a moved session takes its runs along)."""
        if not model_ids:
            return {}
        stmt = (select(TrainingRunRow.model_id, SessionRow.project_id)
                .join(SessionRow, SessionRow.session_id == TrainingRunRow.session_id)
                .where(TrainingRunRow.model_id.in_(model_ids)))
        return dict(self.store.rows(stmt))
