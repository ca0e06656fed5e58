"""Sessions, and what hangs off a session alone (its projects, its custom losses), behind
repositories: control/sessions.py, control/projects.py, control/custom_losses.py and control/training_runs.py
hold the rules, the queries are here. Sessions come out as frozen Session dataclasses, not rows."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import func, or_, select

from tinkerd.control.store.db import Store
from tinkerd.control.store.repository import Keyed, plain_dict, plain_list
from tinkerd.control.store.tables import CheckpointRow, CustomLossRow, SessionRow, TrainingRunRow


@dataclass(frozen=True)
class Session:
    session_id: str
    # The account of the key that created it (its runs, checkpoints and samplers are that account's);
    # None only for internal callers.
    account_id: str | None
    created_at: datetime
    last_heartbeat_at: datetime
    tags: list
    user_metadata: dict
    sdk_version: str | None
    finished_reason: str | None  # None: active
    display_name: str | None
    project_id: str | None


class SessionRepository(Keyed[Session]):
    row, item = SessionRow, Session
    fix = {"tags": plain_list, "user_metadata": plain_dict}


    def all(self) -> list[Session]:
        return [self._item(r) for r in self.store.query(select(SessionRow))]

    def ids_of_account(self, account_id: str, limit: int, offset: int) -> list[str]:
        """A page of the account's session ids, newest first."""
        return self.store.query(select(SessionRow.session_id).where(SessionRow.account_id == account_id)
                                .order_by(SessionRow.created_at.desc(), SessionRow.session_id)
                                .limit(limit).offset(offset))

    def of_account(self, account_id: str, project_ids: list[str] | None = None,
                   after: tuple[datetime, str] | None = None) -> list[Session]:
        """The account's sessions (of `project_ids` when given), newest first, after the cursor
        (created_at, session_id) when given."""
        stmt = select(SessionRow).where(SessionRow.account_id == account_id)
        if project_ids is not None:
            stmt = stmt.where(SessionRow.project_id.in_(project_ids))
        if after is not None:
            at, sid = after
            stmt = stmt.where((SessionRow.created_at < at) | ((SessionRow.created_at == at) & (SessionRow.session_id > sid)))
        return [self._item(r) for r in self.store.query(stmt.order_by(SessionRow.created_at.desc(), SessionRow.session_id))]

    def by_ids(self, session_ids) -> list[Session]:
        if not session_ids:
            return []
        return [self._item(r) for r in self.store.query(select(SessionRow).where(SessionRow.session_id.in_(list(session_ids))))]

    def heard_from_since(self, session_ids, since: datetime) -> set[str]:
        """Those of `session_ids` that sent a heartbeat at or after `since`."""
        return set(self.store.query(select(SessionRow.session_id).where(
            SessionRow.session_id.in_(list(session_ids)), SessionRow.last_heartbeat_at >= since)))

    def projects_in(self, account_id: str, project_ids: list[str]) -> set[str]:
        """Those of `project_ids` that one of the account's sessions is in."""
        return set(self.store.query(select(SessionRow.project_id).where(
            SessionRow.account_id == account_id, SessionRow.project_id.in_(project_ids)).distinct()))

    def projects_of_runs(self, model_ids) -> dict[str, str | None]:
        """model_id -> the project of its session now (a moved session takes its runs along)."""
        if not model_ids:
            return {}
        stmt = (select(TrainingRunRow.model_id, SessionRow.project_id)
                .join(SessionRow, SessionRow.session_id == TrainingRunRow.session_id)
                .where(TrainingRunRow.model_id.in_(list(model_ids))))
        return {model_id: project for model_id, project in self.store.rows(stmt)}

    def checkpoint_totals(self, session_ids: list[str], now: datetime) -> dict[str, tuple[int, int]]:
        """session_id -> (live checkpoint count, their bytes)."""
        if not session_ids:
            return {}
        # Live rows only, filtered rather than swept: removal is CheckpointSweeper's (control/checkpoints.py).
        live = or_(CheckpointRow.expires_at.is_(None), CheckpointRow.expires_at > now)
        stmt = (select(TrainingRunRow.session_id, func.count(CheckpointRow.tinker_path),
                       func.coalesce(func.sum(CheckpointRow.size_bytes), 0))
                .join(CheckpointRow, CheckpointRow.model_id == TrainingRunRow.model_id)
                .where(TrainingRunRow.session_id.in_(session_ids), live).group_by(TrainingRunRow.session_id))
        return {sid: (int(n), int(b)) for sid, n, b in self.store.rows(stmt)}


class CustomLossRepository:
    def __init__(self, store: Store):
        self.store = store

    def get(self, loss_id: str) -> CustomLossRow | None:
        return self.store.get(CustomLossRow, loss_id)

    def add(self, row: CustomLossRow) -> bool:
        return self.store.add(row)

    def count_of_session(self, session_id: str) -> int:
        return int(self.store.query(select(func.count()).select_from(CustomLossRow)
                                    .where(CustomLossRow.session_id == session_id))[0])
