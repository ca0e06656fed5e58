"""Metering: one usage record per completed operation, and hourly billing buckets read from them.

The api layer knows what an op costs (it decoded the tokens), so it attaches a `Billing` to the op's
Work; the worker records it with the op's timings when the op completes. Quantities are stored raw
and priced when read. Queue wait (accepted -> handed to the engine) is recorded so operators can see
it, and is never part of a billed quantity or a cost.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from datetime import datetime, timedelta
from typing import Any, Callable

from tinkerd.control.store.db import Store, utcnow
from tinkerd.control.store.usage import UsageRecord, UsageRepository

# Billed token kinds -> the SDK's billing event type (forward-only passes are billed as training,
# at their own rate).
TOKEN_KINDS = {
    "trained_tokens": "training",
    "forward_tokens": "training",
    "prefill_tokens": "sampling_prefill",
    "sampled_tokens": "sampling_sample",
}


@dataclass
class Usage:
    prefill_tokens: int = 0  # prompt tokens, once per sample request whatever num_samples is
    sampled_tokens: int = 0  # generated tokens over all sequences
    trained_tokens: int = 0  # forward_backward target positions
    forward_tokens: int = 0  # forward-only target positions
    checkpoints: int = 0  # checkpoints written


@dataclass
class Billing:
    """Who pays for an op and how to count what it consumed from its result."""

    account_id: str | None
    session_id: str | None
    base_model: str | None
    count: Callable[[Any], Usage]


class Meter:
    def __init__(self, store: Store):
        self.store = store
        self.usage = UsageRepository(store)
        # Called with (request_id, account_id, usage) for every recorded op: the quotas' token window.
        self.listeners: list[Callable[[str, str | None, Usage], None]] = []

    def record(self, request_id: str, request_type: str, target: str, billing: Billing, result: Any,
               queue_wait_s: float, compute_s: float) -> None:
        usage = billing.count(result)
        record = UsageRecord(request_id=request_id, account_id=billing.account_id, session_id=billing.session_id,
                             target=target, base_model=billing.base_model, request_type=request_type,
                             queue_wait_s=max(queue_wait_s, 0.0), compute_s=compute_s, completed_at=utcnow(),
                             **{f.name: getattr(usage, f.name) for f in fields(Usage)})
        self.usage.add(record)
        for listener in self.listeners:
            listener(request_id, billing.account_id, usage)

    def rows(self, account_id: str | None = None, start: datetime | None = None,
             end: datetime | None = None) -> list[UsageRecord]:
        return self.usage.rows(account_id, start, end)


@dataclass
class Bucket:
    """One hour of one billed quantity of one (account, session, base model)."""

    start: datetime
    kind: str  # a UsageRecord quantity (trained_tokens, ..., checkpoints) or "storage_gb_hours"
    account_id: str | None
    session_id: str | None
    base_model: str | None
    quantity: float = 0  # an int for tokens and checkpoints


def hourly_buckets(rows: list[UsageRecord]) -> list[Bucket]:
    buckets: dict[tuple, Bucket] = {}
    for row in rows:
        hour = row.completed_at.replace(minute=0, second=0, microsecond=0)
        for kind in (*TOKEN_KINDS, "checkpoints"):
            n = getattr(row, kind) or 0
            if n:
                key = (hour, kind, row.account_id, row.session_id, row.base_model)
                buckets.setdefault(key, Bucket(*key)).quantity += n
    # Ordered by bucket, then descending quantity, as the SDK documents.
    return sorted(buckets.values(), key=lambda b: (b.start, -b.quantity, b.kind))


def bucket_end(b: Bucket) -> datetime:
    return b.start + timedelta(hours=1)


def totals(rows: list[UsageRecord]) -> dict[str | None, dict[str, float]]:
    """account_id -> quantity (token kinds, checkpoints, queue_wait_s, compute_s, ops) summed."""
    out: dict[str | None, dict[str, float]] = {}
    for row in rows:
        t = out.setdefault(row.account_id, {k: 0 for k in (*TOKEN_KINDS, "checkpoints", "queue_wait_s", "compute_s", "ops")})
        for k in (*TOKEN_KINDS, "checkpoints", "queue_wait_s", "compute_s"):
            t[k] += getattr(row, k) or 0
        t["ops"] += 1
    return out
