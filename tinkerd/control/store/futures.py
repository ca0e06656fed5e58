"""The futures table (the op log, docs/op-contract.md) behind a repository: the reads and writes
the api layer and the one-time conversion of pre-op-log rows (api/legacy.py) make, so that neither
runs queries of its own. Control's own bookkeeping (submit, results, recovery, retention) still
queries the table in its modules; they move here as they are touched."""

from __future__ import annotations

from sqlalchemy import func, or_, select, update

from tinkerd.control.clock import utcnow
from tinkerd.control.store.db import Store
from tinkerd.control.store.tables import FutureRow


class FutureRepository:
    def __init__(self, store: Store):
        self.store = store

    def get(self, request_id: str) -> FutureRow | None:
        return self.store.get(FutureRow, request_id)

    def unconverted(self, state_changing: tuple[str, ...] | set[str]) -> list[FutureRow]:
        """Rows an older tinkerd stored as raw HTTP bodies that recovery would read: pending ones, and
        complete ones of a state-changing type; in the order they were accepted."""
        return self.store.query(select(FutureRow).where(
            FutureRow.op_version.is_(None), FutureRow.body != b"",
            (FutureRow.status == "pending") | ((FutureRow.status == "complete") & FutureRow.request_type.in_(state_changing)))
            .order_by(FutureRow.created_at, FutureRow.seq_id))

    def of(self, target: str | None = None, request_type: str | None = None,
           status: str | None = None) -> list[FutureRow]:
        """The log's rows, optionally of one target, op type or status, in seq_id then acceptance
        order (tinkerd fsck and the tests read the log through this, on either backend)."""
        stmt = select(FutureRow)
        for column, value in ((FutureRow.target, target), (FutureRow.request_type, request_type),
                              (FutureRow.status, status)):
            if value is not None:
                stmt = stmt.where(column == value)
        return self.store.query(stmt.order_by(FutureRow.seq_id, FutureRow.created_at))

    def fail(self, request_id: str, error: str, category: str) -> None:
        self.store.update(FutureRow, request_id, status="failed", error=error, error_category=category,
                          completed_at=utcnow())

    def set_record(self, request_id: str, body: bytes, op_version: int) -> None:
        self.store.update(FutureRow, request_id, body=body, op_version=op_version)

    def first_training_op(self, model_id: str) -> tuple[int | None] | None:
        """The seq_id of the model's first op after its creation, in a 1-tuple (None inside: an op
        without seq_id), or None when it has had none; which ordering the model's ops follow
        (api/hpcai.py: check_ordering)."""
        first = self.store.query(
            select(FutureRow.seq_id)
            .where(FutureRow.target == model_id, FutureRow.request_type.not_in(("CreateModel", "UnloadModel")),
                   or_(FutureRow.seq_id.is_(None), FutureRow.seq_id > 0))
            .order_by(FutureRow.created_at).limit(1))
        return (first[0],) if first else None

    # -- claims: which engine driver queues a pending op (control/claims.py) -----------------------

    def claim(self, worker_id: str, limit: int = 256) -> list[FutureRow]:
        """Take pending ops nobody claimed yet for `worker_id`, in the order they were accepted. FOR
        UPDATE SKIP LOCKED: two drivers claiming at once each get other rows, never the same one, and
        neither waits on the other's transaction (SQLite, one process, ignores the clause)."""
        with self.store.write() as s:
            rows = list(s.scalars(
                select(FutureRow).where(FutureRow.status == "pending", FutureRow.claimed_by.is_(None))
                .order_by(FutureRow.created_at, FutureRow.seq_id).limit(limit)
                .with_for_update(skip_locked=True)))
            for row in rows:
                row.claimed_by = worker_id
        return rows

    def claim_all_pending(self, worker_id: str) -> int:
        """At the driver's start, before recovery reads them: every pending op is this driver's, the
        ones a previous driver (now gone) claimed included. Returns how many."""
        with self.store.write() as s:
            return s.execute(update(FutureRow).where(FutureRow.status == "pending")
                             .values(claimed_by=worker_id)).rowcount

    # -- what api replicas learn of the driver's queue (docs/deployment.md) -----------------------

    def pending_count(self, target: str | None = None) -> int:
        """Ops accepted and not finished (unclaimed, waiting in the driver's queue, or in its
        engine), of one target or all: the back-pressure budget's count with replicas
        (control/backpressure.py)."""
        stmt = select(func.count()).select_from(FutureRow).where(FutureRow.status == "pending")
        if target is not None:
            stmt = stmt.where(FutureRow.target == target)
        return self.store.query(stmt)[0]

    def post_pauses(self, reasons: dict[str, str | None]) -> None:
        """The driver's quota pauses that changed (request_id -> reason, None: no longer held), in
        one transaction (control/pauses.py)."""
        with self.store.write() as s:
            for request_id, reason in reasons.items():
                s.execute(update(FutureRow).where(FutureRow.request_id == request_id).values(paused_reason=reason))

    def paused_reason(self, request_id: str) -> str | None:
        """What the driver last posted for a pending op (an api replica's retrieve_future)."""
        found = self.store.query(select(FutureRow.paused_reason).where(FutureRow.request_id == request_id,
                                                                       FutureRow.status == "pending"))
        return found[0] if found else None

    def unloaded_since(self, since) -> list[str]:
        """The runs hpcai's unload_model was asked for since `since` (their UnloadModel futures): what
        a driver whose listener was away may have missed (store/listen.py)."""
        return self.store.query(select(FutureRow.target).where(FutureRow.request_type == "UnloadModel",
                                                               FutureRow.created_at >= since).distinct())
