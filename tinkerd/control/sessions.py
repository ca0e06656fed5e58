"""Sessions: creating, heart-beating and finishing them, who owns them, and reading them for the
SDK's RestClient (list, get, search; one account's sessions only).

Ownership: a session belongs to the account of the key that created it; its runs, their checkpoints
and its sampling sessions belong to the same account. The `owned*` lookups (here, and in
training_runs.py, checkpoints.py, sampling_sessions.py through `Sessions.lookup`) answer another
account's ids exactly like missing ones (NotFoundError, same message), so nothing leaks that an id
exists. `account_id=None` means an internal caller (recovery, tests) and skips the check.

A session's status comes from what tinkerd records: `finished_reason` (the client's finish reason)
or none yet (active). tinkerd never cancels or fails a whole session, so those statuses match nothing.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Callable

from tinkerd.control.audit import AuditLog
from tinkerd.control.store.db import Store, utcnow
from tinkerd.control.store.runs import RunRepository
from tinkerd.control.store.sampling import SamplingSessionRepository
from tinkerd.control.store.sessions import Session, SessionRepository
from tinkerd.errors import NotFoundError

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
    def __init__(self, store: Store, audit: AuditLog | None = None):
        self.store = store
        self.sessions = SessionRepository(store)
        self.audit = audit or AuditLog(store)
        # The data directory's free-space reserve (control/diskspace.py): a new session is new work,
        # refused under it. None (tests) never refuses.
        self.reserve = None

    def create_session(self, tags: list[str], user_metadata: dict, sdk_version: str | None,
                       account_id: str | None = None, display_name: str | None = None,
                       project_id: str | None = None, session_id: str | None = None) -> str:
        """A new session; `session_id`: a fixed id (an API key's implicit session, api/hpcai.py)."""
        if self.reserve is not None:
            self.reserve.check()
        session_id = session_id or f"sess-{secrets.token_hex(8)}"
        now = utcnow()
        self.sessions.add(Session(session_id=session_id, account_id=account_id, created_at=now, last_heartbeat_at=now,
                                  tags=list(tags or []), user_metadata=dict(user_metadata or {}), sdk_version=sdk_version,
                                  finished_reason=None, display_name=display_name, project_id=project_id))
        return session_id

    def lookup(self, get: Callable[[str], Any], key: str, what: str, account_id: str | None = None):
        """What `get` finds under `key`, or NotFoundError; with an account, another account's is
        missing too (same message, so existence never leaks). Non-sessions are owned through their session."""
        row = get(key)
        if row is not None and account_id is not None:
            owner = row.account_id if isinstance(row, Session) else self.account_of(row.session_id)
            if owner != account_id:
                row = None
        if row is None:
            raise NotFoundError(f"unknown {what} {key!r}")
        return row

    def session(self, session_id: str) -> Session:
        return self.lookup(self.sessions.get, session_id, "session_id")

    def owned_session(self, session_id: str, account_id: str | None) -> Session:
        return self.lookup(self.sessions.get, session_id, "session_id", account_id)

    def session_exists(self, session_id: str) -> bool:
        return self.sessions.get(session_id) is not None

    def account_of(self, session_id: str) -> str | None:
        row = self.sessions.get(session_id)
        return row.account_id if row is not None else None

    def set_project(self, session_id: str, project_id: str, account_id: str | None) -> None:
        row = self.owned_session(session_id, account_id)
        self.sessions.set(session_id, project_id=project_id)
        self.audit.record("project_session_assigned", row.account_id, session_id=session_id, project_id=project_id,
                          previous_project_id=row.project_id)

    def heartbeat(self, session_id: str, account_id: str | None = None) -> None:
        self.owned_session(session_id, account_id)
        self.sessions.set(session_id, last_heartbeat_at=utcnow())

    def finish_session(self, session_id: str, reason: str | None, account_id: str | None = None) -> None:
        self.owned_session(session_id, account_id)
        self.sessions.set(session_id, finished_reason=reason or "unknown")

    def list(self, account_id: str, limit: int, offset: int) -> list[str]:
        return self.sessions.ids_of_account(account_id, limit, offset)

    def get(self, session_id: str, account_id: str) -> tuple[Session, list[str], list[str]]:
        row = self.owned_session(session_id, account_id)
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
