"""Reading sessions for the SDK's RestClient: list, get, search. One account's sessions only.

A session's status comes from what tinkerd records: `finished_reason` (the client's finish reason)
or none yet (active). tinkerd never cancels or fails a whole session, so those statuses match nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime

from tinkerd.control.runs import Runs
from tinkerd.control.store.db import utcnow
from tinkerd.control.store.runs import RunRepository
from tinkerd.control.store.sampling import SamplingSessionRepository
from tinkerd.control.store.sessions import Session, SessionRepository

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


def status_of(row: Session) -> dict:
    if row.finished_reason is None:
        return {"type": "active"}
    if row.finished_reason in CLIENT_REASONS:
        return {"type": "client_finished", "reason": {"type": row.finished_reason}}
    return None  # finished for a reason the SDK has no status for (tinkerd's own, or unknown)


def _matches_status(row: Session, queries: list[dict] | None) -> bool:
    if queries is None:
        return True
    for q in queries:
        if q["type"] == "active" and row.finished_reason is None:
            return True
        if q["type"] == "client_finished" and row.finished_reason in (q.get("reasons") or CLIENT_REASONS):
            return True
    return False


def _matches_name(row: Session, display_name: str) -> bool:
    name = (row.display_name or "").lower()
    return all(word in name for word in display_name.lower().split())


class Sessions:
    def __init__(self, runs: Runs):
        self.runs = runs
        self.store = runs.store
        self.sessions = SessionRepository(runs.store)

    def list(self, account_id: str, limit: int, offset: int) -> list[str]:
        return self.sessions.ids_of_account(account_id, limit, offset)

    def get(self, session_id: str, account_id: str) -> tuple[Session, list[str], list[str]]:
        row = self.runs.owned_session(session_id, account_id)
        runs = RunRepository(self.store).ids_of_session(session_id)
        samplers = SamplingSessionRepository(self.store).ids_of_session(session_id)
        return row, runs, samplers

    def search(self, account_id: str, q: SessionSearch) -> tuple[list[Session], bool]:
        """A page of the account's matching sessions, newest first, and whether more follow."""
        page: list[Session] = []
        for row in self.sessions.of_account(account_id, q.project_ids, q.after):
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
        return self.sessions.checkpoint_totals(session_ids, utcnow())

    def by_ids(self, session_ids: set[str]) -> list[Session]:
        return self.sessions.by_ids(session_ids)

    def projects_of_runs(self, model_ids: set[str]) -> dict[str, str | None]:
        """model_id -> the project of its session now (a moved session takes its runs along)."""
        return self.sessions.projects_of_runs(model_ids)
