"""The futures table (the op log, docs/op-contract.md) and its retention watermarks behind a
repository: every query on them, for the api layer, the one-time conversion of pre-op-log rows
(api/legacy.py), recovery, retention, completions, traces and fsck (no module outside store/ builds
one; tests/unit/test_store_access.py checks)."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import delete, func, or_, select, update

from tinkerd.control.clock import utcnow
from tinkerd.control.store.db import Store
from tinkerd.control.store.tables import FutureRow, FutureWatermarkRow, UsageRow

# The columns of a FutureRef, in its fields' order.
_REF = (FutureRow.request_id, FutureRow.request_type, FutureRow.target, FutureRow.seq_id, FutureRow.status,
        FutureRow.account_id)


@dataclass(frozen=True)
class FutureRef:
    """What the retention sweep decides on about one future (control/retention.py)."""

    request_id: str
    request_type: str
    target: str
    seq_id: int | None
    status: str
    account_id: str | None


@dataclass(frozen=True)
class TracedOp:
    """One op of a session's trace (control/traces.py): its future's times and sizes, its usage."""

    request_id: str
    request_type: str
    target: str
    seq_id: int | None
    status: str
    error: str | None
    created_at: datetime
    completed_at: datetime | None
    compute_s: float | None
    request_bytes: int | None
    result_bytes: int | None
    queue_wait_s: float | None
    prefill_tokens: int | None
    sampled_tokens: int | None
    trained_tokens: int | None
    forward_tokens: int | None


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

    def status(self, request_id: str) -> str | None:
        """A stored future's status (pending, complete, failed), None if there is none: one column."""
        rows = self.store.query(select(FutureRow.status).where(FutureRow.request_id == request_id))
        return rows[0] if rows else None

    def seq_and_type(self, request_id: str) -> tuple[int | None, str] | None:
        """(seq_id, request_type) of a stored future, None if there is none: two columns, not the
        row with its op body (a forward_backward's datums)."""
        rows = self.store.rows(select(FutureRow.seq_id, FutureRow.request_type).where(FutureRow.request_id == request_id))
        return (rows[0].seq_id, rows[0].request_type) if rows else None

    def mark_retrieved(self, request_id: str, at: datetime) -> None:
        """retrieved_at = at, unless a retrieve set it first: one UPDATE, no read."""
        with self.store.write() as s:
            s.execute(update(FutureRow).where(FutureRow.request_id == request_id, FutureRow.retrieved_at.is_(None))
                      .values(retrieved_at=at))

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

    # -- recovery (control/recovery.py) and fsck ---------------------------------------------------

    def pending(self) -> list[FutureRow]:
        """Accepted ops that never finished, in the order they must run again."""
        return self.store.query(select(FutureRow).where(FutureRow.status == "pending")
                                .order_by(FutureRow.created_at, FutureRow.seq_id))

    def completed_seqs(self, model_id: str, request_types) -> list[int]:
        """The seq_ids of the run's completed ops of these types."""
        return self.store.query(select(FutureRow.seq_id).where(
            FutureRow.target == model_id, FutureRow.request_type.in_(list(request_types)),
            FutureRow.status == "complete", FutureRow.seq_id.is_not(None)))

    def completed_at(self, model_id: str, seq_id: int, request_types) -> bool:
        """Whether the run's op at `seq_id`, of one of these types, completed."""
        return bool(self.store.query(select(FutureRow.request_id).where(
            FutureRow.target == model_id, FutureRow.seq_id == seq_id,
            FutureRow.request_type.in_(list(request_types)), FutureRow.status == "complete").limit(1)))

    def completed_of(self, request_types, targets=None) -> list[FutureRow]:
        """Completed ops of these types (of `targets` when given), by target then seq_id."""
        stmt = select(FutureRow).where(FutureRow.status == "complete", FutureRow.request_type.in_(list(request_types)))
        if targets is not None:
            stmt = stmt.where(FutureRow.target.in_(list(targets)))
        return self.store.query(stmt.order_by(FutureRow.target, FutureRow.seq_id))

    def bodiless_after(self, model_id: str, seq_id: int, request_types) -> list[str]:
        """request_ids of the run's completed ops of these types after `seq_id` whose stored op the
        retention sweep cleared (recovery would need it)."""
        return self.store.query(select(FutureRow.request_id).where(
            FutureRow.target == model_id, FutureRow.status == "complete", FutureRow.request_type.in_(list(request_types)),
            FutureRow.seq_id > seq_id, FutureRow.body == b""))

    # -- completions and traces ---------------------------------------------------------------------

    def unheard_samples(self, target: str, seq_from: int, seq_to: int, completed_after: datetime,
                        limit: int) -> list[FutureRow]:
        """Finished, never retrieved Sample ops of a sampling session with seq_id in [seq_from, seq_to),
        completed after `completed_after`, oldest completion first."""
        return self.store.query(
            select(FutureRow)
            .where(FutureRow.target == target, FutureRow.request_type == "Sample",
                   FutureRow.seq_id >= seq_from, FutureRow.seq_id < seq_to,
                   FutureRow.status != "pending", FutureRow.retrieved_at.is_(None),
                   FutureRow.completed_at > completed_after)
            .order_by(FutureRow.completed_at).limit(limit))

    def traced(self, targets: list[str], limit: int) -> list[TracedOp]:
        """The newest `limit` ops of these targets, newest first, with their metered usage."""
        stmt = (select(FutureRow.request_id, FutureRow.request_type, FutureRow.target, FutureRow.seq_id,
                       FutureRow.status, FutureRow.error, FutureRow.created_at, FutureRow.completed_at,
                       FutureRow.compute_s, func.length(FutureRow.body), func.length(FutureRow.result),
                       UsageRow.queue_wait_s, UsageRow.prefill_tokens, UsageRow.sampled_tokens,
                       UsageRow.trained_tokens, UsageRow.forward_tokens)
                .outerjoin(UsageRow, UsageRow.request_id == FutureRow.request_id)
                .where(FutureRow.target.in_(targets)).order_by(FutureRow.created_at.desc()).limit(limit))
        return [TracedOp(*r) for r in self.store.rows(stmt)]

    # -- retention (control/retention.py) -------------------------------------------------------------

    def watermark(self, dedupe_prefix: str) -> int | None:
        """The highest forgotten seq_id of a dedupe identity, if any was forgotten."""
        mark = self.store.get(FutureWatermarkRow, dedupe_prefix)
        return mark.seq_id if mark is not None else None

    def sampler_watermarks(self) -> list[str]:
        """The dedupe prefixes of sampling sessions' watermarks."""
        return self.store.query(select(FutureWatermarkRow.dedupe_prefix).where(
            FutureWatermarkRow.dedupe_prefix.like("%:sample:%")))

    def drop_watermarks(self, dedupe_prefixes: list[str]) -> None:
        with self.store.write() as s:
            s.execute(delete(FutureWatermarkRow).where(FutureWatermarkRow.dedupe_prefix.in_(dedupe_prefixes)))

    def due_to_expire(self, retrieved_before: datetime, completed_before: datetime, limit: int) -> list[FutureRef]:
        """Up to `limit` finished, not yet expired futures retrieved before the first time or
        completed before the second."""
        stmt = (select(*_REF).where(FutureRow.status != "pending", FutureRow.expired_at.is_(None),
                                    or_(FutureRow.retrieved_at < retrieved_before,
                                        FutureRow.completed_at < completed_before)).limit(limit))
        return [FutureRef(*r) for r in self.store.rows(stmt)]

    def expire(self, keep_body: list[str], drop_body: list[str], now: datetime) -> None:
        """Clear these futures' results and errors (making them tombstones); the ops of `drop_body`
        lose their stored op too. One transaction."""
        cleared = dict(result=None, result_media_type=None, error=None, expired_at=now)
        with self.store.write() as s:
            if keep_body:
                s.execute(update(FutureRow).where(FutureRow.request_id.in_(keep_body)).values(**cleared))
            if drop_body:
                s.execute(update(FutureRow).where(FutureRow.request_id.in_(drop_body)).values(body=b"", **cleared))

    def tombstones(self, expired_before: datetime, after: str, limit: int) -> list[FutureRef]:
        """Up to `limit` futures expired before `expired_before`, by request_id after `after`."""
        stmt = (select(*_REF).where(FutureRow.expired_at < expired_before, FutureRow.request_id > after)
                .order_by(FutureRow.request_id).limit(limit))
        return [FutureRef(*r) for r in self.store.rows(stmt)]

    def forget(self, request_ids: list[str], marks: dict[str, int]) -> None:
        """Delete these futures and raise the watermarks to `marks` (dedupe prefix -> seq_id), in one
        transaction: a re-send finds either the row (dedupe) or the raised watermark."""
        with self.store.write() as s:
            for key, seq in marks.items():
                mark = s.get(FutureWatermarkRow, key)
                if mark is None:
                    s.add(FutureWatermarkRow(dedupe_prefix=key, seq_id=seq))
                elif seq > mark.seq_id:
                    mark.seq_id = seq
            s.execute(delete(FutureRow).where(FutureRow.request_id.in_(request_ids)))

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
