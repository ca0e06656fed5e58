"""Retention of finished futures, so the store stays bounded instead of growing with every op.

Every accepted op is a FutureRow: its wire request (the write-ahead log entry) and, once done, its
result. A finished future goes through two stages:

1. Expired: `retrieved_grace_s` (default 600 s) after retrieve_future first handed out its result
   or error, or `max_age_s` (default 24 h) after it finished if nobody ever retrieved it. The result
   and error are cleared; the row stays as a tombstone, so its owner's retrieve_future answers
   "expired" (404, which the SDK raises as a ValueError at once: api/routes/futures.py) and a re-sent
   request with its (target, seq_id) still finds it and is not run again. The grace is 20x the
   SDK's 30 s longest reconnect backoff, for a re-poll after a lost response; the SDK polls every
   future as soon as it is created, so a result still unretrieved after 24 h has no client waiting.
2. Forgotten: `tombstone_s` (default 24 h) after it expired the row is deleted. From then on its
   request_id answers like an unknown one (404), and a re-send of its (target, seq_id) is refused
   with a user error (FutureWatermarkRow): the highest forgotten seq_id per request type, account
   and target is kept, one row per run, not per op.

What recovery still needs is never deleted, and its body never cleared: pending ops; a training
run's creating op (seq_id 0: quotas count a run as live once it is created); and the completed
state-changing ops at or after the run's latest usable snapshot (recovery.py rebuilds an adapter
from that snapshot, validated by its op's row, plus the ops after it). Snapshots only move forward
and the engine keeps the two newest, so an op before the latest usable one is never replayed again.
Such rows may expire (their result goes) but are forgotten only once a later snapshot passes them.
Usage rows (billing) are separate and never touched.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import datetime, timedelta

from tinkerd.control.periodic import Periodic
from tinkerd.control.recovery import STATE_CHANGING, Recovery
from tinkerd.control.store.db import Store, utcnow
from tinkerd.control.store.futures import FutureRef, FutureRepository
from tinkerd.control.store.sampling import SamplingSessionRepository

log = logging.getLogger(__name__)

# Creating ops of a training run (seq_id 0); control/quotas.py counts a run as created by them.
_CREATES = ("CreateModel", "LoadWeights")
# Rows changed per write transaction: short, so a submit waiting on the writer lock waits ~ms.
_BATCH = 500


def dedupe_prefix(request_type: str, account_id: str | None, target: str) -> str:
    """The dedupe key without its seq_id (dedupe_key below builds the key as prefix|seq_id)."""
    return f"{request_type}|{account_id}|{target}"


def dedupe_key(request_type: str, account_id: str | None, target: str, seq_id: int | None,
               idempotency_key: str | None = None) -> str | None:
    """What makes a re-send the same request: (target, seq_id) when the op has a seq_id, else the
    client's idempotency key (hpcai's X-Idempotency-Key); None when it has neither."""
    if seq_id is not None:
        return f"{dedupe_prefix(request_type, account_id, target)}|{seq_id}"
    if idempotency_key:
        return f"{dedupe_prefix(request_type, account_id, target)}|key:{idempotency_key}"
    return None


def forgotten(store: Store, request_type: str, account_id: str | None, target: str, seq_id: int) -> bool:
    """Whether a request with this (target, seq_id) was accepted once and its future since deleted."""
    mark = FutureRepository(store).watermark(dedupe_prefix(request_type, account_id, target))
    return mark is not None and seq_id <= mark


@dataclass
class SweepReport:
    expired: int
    forgotten: int
    marks_dropped: int = 0


class FutureRetention(Periodic):
    thread_name = "tinkerd-future-retention"

    def __init__(self, store: Store, recovery: Recovery | None, retrieved_grace_s: float = 600.0,
                 max_age_s: float = 86400.0, tombstone_s: float = 86400.0):
        self.store = store
        self.futures = FutureRepository(store)
        # None: no snapshots, so every state-changing op stays (unit tests without recovery).
        self.recovery = recovery
        self.retrieved_grace_s = retrieved_grace_s
        self.max_age_s = max_age_s
        self.tombstone_s = tombstone_s
        # A quarter of the shortest period, within [0.5 s, 60 s]: a future outlives its retention by
        # at most ~25% (60 s against the default 600 s grace), and a sweep is a few indexed queries.
        super().__init__(min(60.0, max(0.5, min(retrieved_grace_s, max_age_s, tombstone_s) / 4)))

    def expired_message(self, request_id: str) -> str:
        return (f"request_id {request_id!r} has expired: a result is kept {self.retrieved_grace_s:g} s after it is "
                f"first retrieved and {self.max_age_s:g} s after the op finished at most. The op ran once; "
                f"sending it again does not run it again")

    # -- the sweeper thread ----------------------------------------------------------------------

    def tick(self) -> None:
        report = self.sweep()
        if report.expired or report.forgotten:
            log.info("future retention: %d expired, %d forgotten", report.expired, report.forgotten)

    # -- one sweep -------------------------------------------------------------------------------

    def sweep(self, now: datetime | None = None) -> SweepReport:
        now = now or utcnow()
        snapshots: dict[str, int | None] = {}  # target -> latest usable snapshot seq, per sweep
        expired, forgotten = self._expire(now, snapshots), self._forget(now, snapshots)
        return SweepReport(expired, forgotten, self._drop_marks_of_gone_samplers())

    def _drop_marks_of_gone_samplers(self) -> int:
        """Delete the watermarks of sampling sessions that no longer exist. A request to a deleted
        sampler is a 404 before any dedupe (api/routes/sampling.py), so its watermark guards nothing;
        kept, they were one row per sampler for good, and an RL loop makes a sampler per step
        (save_weights_and_get_sampling_client; found by benchmarks/soak.py)."""
        marks = self.futures.sampler_watermarks()
        by_target: dict[str, list[str]] = {}
        for key in marks:
            by_target.setdefault(key.split("|", 2)[-1], []).append(key)
        live = SamplingSessionRepository(self.store).existing(by_target)
        gone = [key for target, keys in by_target.items() if target not in live for key in keys]
        if gone:
            self.futures.drop_watermarks(gone)
        return len(gone)

    def _expire(self, now: datetime, snapshots: dict) -> int:
        retrieved_before = now - timedelta(seconds=self.retrieved_grace_s)
        completed_before = now - timedelta(seconds=self.max_age_s)
        n = 0
        while rows := self.futures.due_to_expire(retrieved_before, completed_before, _BATCH):
            keep_body = [r.request_id for r in rows if self._needed(r, snapshots)]
            drop_body = [r.request_id for r in rows if r.request_id not in set(keep_body)]
            self.futures.expire(keep_body, drop_body, now)
            n += len(rows)
        return n

    def _forget(self, now: datetime, snapshots: dict) -> int:
        cutoff = now - timedelta(seconds=self.tombstone_s)
        n, after = 0, ""
        while rows := self.futures.tombstones(cutoff, after, _BATCH):
            after = rows[-1].request_id
            gone = [r for r in rows if not self._needed(r, snapshots)]
            if not gone:
                continue
            marks: dict[str, int] = {}
            for r in gone:
                if r.seq_id is not None:
                    key = dedupe_prefix(r.request_type, r.account_id, r.target)
                    marks[key] = max(marks.get(key, r.seq_id), r.seq_id)
            # One transaction: a re-send finds either the row (dedupe) or the raised watermark.
            self.futures.forget([r.request_id for r in gone], marks)
            n += len(gone)
        return n

    def _needed(self, row: FutureRef, snapshots: dict) -> bool:
        """Whether recovery or the quotas still read this row (and its body)."""
        if row.request_type in _CREATES and row.seq_id == 0:
            return True
        if row.request_type not in STATE_CHANGING or row.status != "complete" or row.seq_id is None:
            return False  # never replayed: failed ops changed nothing, the rest change no adapter
        if row.target not in snapshots:
            snap = self.recovery.latest_snapshot(row.target) if self.recovery is not None else None
            snapshots[row.target] = snap[0] if snap is not None else None
        seq = snapshots[row.target]
        # latest_snapshot validates seq-<S> by the row of op S; replay_plan replays the ops after S.
        return seq is None or row.seq_id >= seq
