"""Training runs, their residency bookkeeping (released, unrecoverable) and their step metrics
behind repositories. control/training_runs.py, residency.py, quotas.py, overview.py and
stepmetrics.py hold the rules; the queries are here. Runs come out as frozen TrainingRun dataclasses,
not rows."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import and_, func, or_, select

from tinkerd.control.store.db import Store
from tinkerd.control.store.repository import Keyed, plain_dict
from tinkerd.control.store.tables import (
    FutureRow,
    SessionRow,
    StepMetricRow,
    TrainingRunRow,
    UnloadedRunRow,
    UnrecoverableRunRow,
)


@dataclass(frozen=True)
class TrainingRun:
    model_id: str  # `{session_id}:train:{model_seq_id}`
    session_id: str  # owned through it (control/sessions.py)
    base_model: str
    lora_rank: int
    lora_config: dict
    user_metadata: dict
    created_at: datetime
    last_request_at: datetime


@dataclass(frozen=True)
class RunState:
    """A run with what its status is made of (control/overview.py turns it into one)."""

    run: TrainingRun
    finished_reason: str | None  # its session's
    released: bool
    unrecoverable: str | None  # why recovery could not rebuild it


class RunRepository(Keyed[TrainingRun]):
    row, item = TrainingRunRow, TrainingRun
    fix = {"lora_config": plain_dict, "user_metadata": plain_dict}


    def all(self) -> list[TrainingRun]:
        return [self._item(r) for r in self.store.query(select(TrainingRunRow))]

    def count_of_session(self, session_id: str) -> int:
        return int(self.store.query(select(func.count()).select_from(TrainingRunRow)
                                    .where(TrainingRunRow.session_id == session_id))[0])

    def ids_of_session(self, session_id: str) -> list[str]:
        """The session's runs, in the order they were created."""
        return self.store.query(select(TrainingRunRow.model_id).where(TrainingRunRow.session_id == session_id)
                                .order_by(TrainingRunRow.created_at, TrainingRunRow.model_id))

    def ids_of_account(self, account_id: str) -> list[str]:
        return self.store.query(_of_account(select(TrainingRunRow.model_id), account_id))

    def page(self, limit: int | None = None, offset: int = 0, account_id: str | None = None,
             project_id: str | None = None) -> tuple[list[TrainingRun], int]:
        """A page of runs (of one account, or all; of one of its projects), newest first, and how many
        there are in all."""
        stmt = select(TrainingRunRow).order_by(TrainingRunRow.created_at.desc(), TrainingRunRow.model_id)
        count = select(func.count()).select_from(TrainingRunRow)
        if account_id is not None:
            stmt, count = _of_account(stmt, account_id), _of_account(count, account_id)
        if project_id is not None:
            stmt, count = stmt.where(SessionRow.project_id == project_id), count.where(SessionRow.project_id == project_id)
        if limit is not None:
            stmt = stmt.limit(limit)
        return [self._item(r) for r in self.store.query(stmt.offset(offset))], int(self.store.query(count)[0])

    def states_of_account(self, account_id: str, limit: int, offset: int) -> tuple[list[RunState], int]:
        """A page of the account's runs with their status rows, newest first (one query, joined), and
        how many it has (one COUNT)."""
        stmt = (select(TrainingRunRow, SessionRow.finished_reason, UnloadedRunRow.model_id.is_not(None),
                       UnrecoverableRunRow.reason)
                .join(SessionRow, SessionRow.session_id == TrainingRunRow.session_id)
                .outerjoin(UnloadedRunRow, UnloadedRunRow.model_id == TrainingRunRow.model_id)
                .outerjoin(UnrecoverableRunRow, UnrecoverableRunRow.model_id == TrainingRunRow.model_id)
                .where(SessionRow.account_id == account_id)
                .order_by(TrainingRunRow.created_at.desc(), TrainingRunRow.model_id)
                .limit(limit).offset(offset))
        count = _of_account(select(func.count()).select_from(TrainingRunRow), account_id)
        states = [RunState(self._item(run), finished, bool(released), broken) for run, finished, released, broken in self.store.rows(stmt)]
        return states, int(self.store.query(count)[0])

    def state(self, run: TrainingRun) -> RunState:
        session = self.store.get(SessionRow, run.session_id)
        broken = self.store.get(UnrecoverableRunRow, run.model_id)
        return RunState(run, session.finished_reason if session else None, self.is_unloaded(run.model_id),
                        broken.reason if broken else None)

    def base_models(self, model_ids) -> dict[str, str]:
        """model_id -> base model, for the runs among `model_ids` (one query)."""
        ids = sorted(set(model_ids))
        if not ids:
            return {}
        return {r.model_id: r.base_model
                for r in self.store.query(select(TrainingRunRow).where(TrainingRunRow.model_id.in_(ids)))}

    def live_of_account(self, account_id: str, creates: tuple[str, ...]) -> set[str]:
        """The account's runs whose creating op (one of `creates` at seq_id 0) completed and that the
        engine has not released: what counts against its concurrent-run quota."""
        created = (select(FutureRow.request_id)
                   .where(FutureRow.target == TrainingRunRow.model_id, FutureRow.seq_id == 0,
                          FutureRow.status == "complete", FutureRow.request_type.in_(creates))
                   .exists())
        released = select(UnloadedRunRow.model_id).where(UnloadedRunRow.model_id == TrainingRunRow.model_id).exists()
        return set(self.store.query(_of_account(select(TrainingRunRow.model_id), account_id).where(created, ~released)))

    # -- released runs (control/residency.py) ------------------------------------------------------

    def idle(self, requested, heard_before: datetime | None) -> list[str]:
        """Loaded runs of ended sessions, runs among `requested`, and (heard_before given) runs whose
        session and own last request are both older than it; by model_id."""
        idle = or_(SessionRow.finished_reason.is_not(None), TrainingRunRow.model_id.in_(list(requested)))
        if heard_before is not None:
            idle = or_(idle, and_(SessionRow.last_heartbeat_at < heard_before,
                                  TrainingRunRow.last_request_at < heard_before))
        return self.store.query(
            select(TrainingRunRow.model_id)
            .join(SessionRow, SessionRow.session_id == TrainingRunRow.session_id)
            .where(idle, TrainingRunRow.model_id.not_in(select(UnloadedRunRow.model_id)))
            .order_by(TrainingRunRow.model_id))

    def unloaded(self, account_id: str | None = None) -> list[str]:
        """The released runs (of one account, or all), by model_id."""
        stmt = select(UnloadedRunRow.model_id).order_by(UnloadedRunRow.model_id)
        if account_id is not None:
            stmt = _of_account(stmt.join(TrainingRunRow, TrainingRunRow.model_id == UnloadedRunRow.model_id), account_id)
        return self.store.query(stmt)

    def is_unloaded(self, model_id: str) -> bool:
        return self.store.get(UnloadedRunRow, model_id) is not None

    def mark_unloaded(self, model_id: str, at: datetime) -> None:
        self.store.add(UnloadedRunRow(model_id=model_id, unloaded_at=at))

    def mark_loaded(self, model_id: str) -> None:
        self.store.delete(UnloadedRunRow, model_id)


class StepMetricRepository:
    def __init__(self, store: Store):
        self.store = store

    def add(self, row: StepMetricRow) -> None:
        self.store.add(row)  # a redone op keeps the first row (same request_id)

    def newest(self, model_id: str, after_seq: int, limit: int) -> list[StepMetricRow]:
        """The run's newest `limit` steps after `after_seq`, newest first."""
        return self.store.query(select(StepMetricRow).where(StepMetricRow.model_id == model_id,
                                                            StepMetricRow.seq_id > after_seq)
                                .order_by(StepMetricRow.seq_id.desc()).limit(limit))


def _of_account(stmt, account_id: str):
    """Restrict a select over TrainingRunRow to runs whose session belongs to the account."""
    return stmt.join(SessionRow, SessionRow.session_id == TrainingRunRow.session_id).where(SessionRow.account_id == account_id)
