"""The checkpoint registry and its storage ledger behind repositories (control/checkpoints.py,
storage.py, costs.py and fsck.py hold the rules; the queries are here). Checkpoints come out as
frozen Checkpoint dataclasses, not rows."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import func, or_, select

from tinkerd.control.store.db import Store
from tinkerd.control.store.repository import Keyed, plain_dict
from tinkerd.control.store.tables import CheckpointRow, CheckpointStorageRow, SessionRow, TrainingRunRow


@dataclass(frozen=True)
class Checkpoint:
    tinker_path: str  # tinker://<model_id>/<segment>/<name>
    model_id: str  # its run's; owned through the run's session
    checkpoint_type: str  # training | sampler | external
    name: str
    dir_path: str  # the artifact key (rows written before keys hold the absolute path)
    created_at: datetime
    expires_at: datetime | None  # None: never
    size_bytes: int | None
    public: bool  # readable by every account
    user_metadata: dict


class CheckpointRepository(Keyed[Checkpoint]):
    row, item = CheckpointRow, Checkpoint
    fix = {"public": bool, "user_metadata": plain_dict}


    def all(self) -> list[Checkpoint]:
        """Every registered checkpoint, expired ones not yet swept included."""
        return [self._item(r) for r in self.store.query(select(CheckpointRow))]

    def expired(self, now: datetime) -> list[Checkpoint]:
        return [self._item(r) for r in self.store.query(select(CheckpointRow).where(CheckpointRow.expires_at <= now))]

    def page(self, now: datetime, model_id: str | None = None, checkpoint_type: str | None = None,
             limit: int | None = None, offset: int = 0, account_id: str | None = None,
             project_id: str | None = None) -> tuple[list[Checkpoint], int]:
        """A page of the checkpoints live at `now` (of one account, or all; of one of its projects,
        run or type), newest first, and how many there are in all."""
        where = [or_(CheckpointRow.expires_at.is_(None), CheckpointRow.expires_at > now)]
        if account_id is not None:
            own = select(TrainingRunRow.model_id).join(SessionRow, SessionRow.session_id == TrainingRunRow.session_id)
            own = own.where(SessionRow.account_id == account_id)
            if project_id is not None:
                own = own.where(SessionRow.project_id == project_id)
            where.append(CheckpointRow.model_id.in_(own))
        if model_id is not None:
            where.append(CheckpointRow.model_id == model_id)
        if checkpoint_type is not None:
            where.append(CheckpointRow.checkpoint_type == checkpoint_type)
        stmt = select(CheckpointRow).where(*where).order_by(CheckpointRow.created_at.desc(), CheckpointRow.tinker_path)
        if limit is not None:
            stmt = stmt.limit(limit)
        count = select(func.count()).select_from(CheckpointRow).where(*where)
        return [self._item(r) for r in self.store.query(stmt.offset(offset))], int(self.store.query(count)[0])

    def newest(self, model_id: str, checkpoint_type: str, now: datetime) -> Checkpoint | None:
        """The run's newest checkpoint of a type live at `now`."""
        rows = self.store.query(
            select(CheckpointRow)
            .where(CheckpointRow.model_id == model_id, CheckpointRow.checkpoint_type == checkpoint_type,
                   or_(CheckpointRow.expires_at.is_(None), CheckpointRow.expires_at > now))
            .order_by(CheckpointRow.created_at.desc()).limit(1))
        return self._item(rows[0]) if rows else None


class CheckpointStorageRepository:
    def __init__(self, store: Store):
        self.store = store

    def ids_of_paths(self, tinker_paths) -> set[str]:
        """The storage ids of every interval (open or closed) of these checkpoints."""
        return set(self.store.query(select(CheckpointStorageRow.storage_id).where(
            CheckpointStorageRow.tinker_path.in_(list(tinker_paths)))))

    def open(self) -> list[CheckpointStorageRow]:
        """Intervals not closed yet."""
        return self.store.query(select(CheckpointStorageRow).where(CheckpointStorageRow.end_at.is_(None)))

    def overlapping(self, account_id: str | None, start: datetime, end: datetime) -> list[CheckpointStorageRow]:
        """Intervals overlapping [start, end), of one account (or all with account_id=None)."""
        stmt = select(CheckpointStorageRow).where(
            CheckpointStorageRow.start_at < end,
            or_(CheckpointStorageRow.end_at.is_(None), CheckpointStorageRow.end_at > start))
        if account_id is not None:
            stmt = stmt.where(CheckpointStorageRow.account_id == account_id)
        return self.store.query(stmt)

    def started_before(self, account_id: str, end: datetime) -> list[CheckpointStorageRow]:
        """The account's intervals that began before `end`."""
        return self.store.query(select(CheckpointStorageRow).where(
            CheckpointStorageRow.account_id == account_id, CheckpointStorageRow.start_at < end))
