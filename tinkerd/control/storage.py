"""Checkpoint storage billing: GB-hours from each checkpoint's size times the time it existed.

One CheckpointStorageRow per registration of a checkpoint: [start_at, end_at) at size_bytes.
- start_at is the checkpoint's created_at; rows are opened lazily, when usage is read (`sync`), so
  the save path writes nothing extra and checkpoints from before this ledger are covered too.
- end_at is set when the checkpoint goes: `removed` (deleted, or its expiry noticed) closes it at
  the removal, or at expires_at when that came first (an expired checkpoint is gone for the API
  from that instant, whenever its files are swept). `sync` also closes rows whose checkpoint was
  overwritten (at the new registration's created_at) or has expired without being removed yet.
- An open row counts up to the time of reading; the current hour's bucket grows until it ends.

GB is 1e9 bytes; an hour of a 1 GB checkpoint is 1 GB-hour; a GB-month is 720 GB-hours (the SDK's
BillingUsageEvent: cost = rate_per_gb_month * gigabyte_hours / 720).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta

from tinkerd.control.metering import Bucket
from tinkerd.control.store.db import Store, utcnow
from tinkerd.control.store.checkpoints import Checkpoint, CheckpointRepository, CheckpointStorageRepository
from tinkerd.control.store.runs import RunRepository
from tinkerd.control.store.sessions import SessionRepository
from tinkerd.control.store.tables import CheckpointStorageRow

BYTES_PER_GB = 1e9
GB_HOURS_PER_GB_MONTH = 720
STORAGE_KIND = "storage_gb_hours"
_HOUR = timedelta(hours=1)


def storage_id(row: Checkpoint) -> str:
    return f"{row.tinker_path}@{row.created_at.isoformat()}"


@dataclass
class Interval:
    account_id: str | None
    base_model: str | None
    size_bytes: int
    start: datetime
    end: datetime | None  # None: still stored


class StorageLedger:
    def __init__(self, store: Store):
        self.store = store
        self.ledger = CheckpointStorageRepository(store)

    def removed(self, row: Checkpoint, now: datetime | None = None) -> None:
        """The checkpoint is being deleted (by a user, or as expired): close its interval."""
        now = now or utcnow()
        end = min(now, row.expires_at) if row.expires_at is not None else now
        self._open(row)
        self.store.update(CheckpointStorageRow, storage_id(row), end_at=max(end, row.created_at))

    def sync(self, now: datetime | None = None) -> None:
        """Open an interval for every live checkpoint that has none; close those whose checkpoint is
        gone, expired or overwritten."""
        now = now or utcnow()
        live = {storage_id(r): r for r in CheckpointRepository(self.store).all()}
        have = self.ledger.ids_of_paths({r.tinker_path for r in live.values()})
        for sid, row in live.items():
            if sid not in have:  # saved since the last read, or before this ledger existed
                self._open(row)
        open_rows = self.ledger.open()
        by_path = {r.tinker_path: r for r in live.values()}
        for r in open_rows:
            ckpt = live.get(r.storage_id)
            if ckpt is not None:
                if ckpt.expires_at is not None and ckpt.expires_at <= now:
                    self.store.update(CheckpointStorageRow, r.storage_id, end_at=max(ckpt.expires_at, r.start_at))
                continue
            newer = by_path.get(r.tinker_path)  # overwritten: the old files went when the new ones came
            end = newer.created_at if newer is not None and newer.created_at >= r.start_at else now
            self.store.update(CheckpointStorageRow, r.storage_id, end_at=end)

    def intervals(self, account_id: str | None, start: datetime, end: datetime) -> list[Interval]:
        """Intervals overlapping [start, end), of one account (or all with account_id=None); read
        after `sync`, an open one is a checkpoint still stored."""
        return [Interval(r.account_id, r.base_model, r.size_bytes, r.start_at, r.end_at)
                for r in self.ledger.overlapping(account_id, start, end)]

    def _open(self, row: Checkpoint) -> None:
        """Insert the checkpoint's interval (no-op if it exists), attributed to the run's account."""
        if self.store.get(CheckpointStorageRow, storage_id(row)) is not None:
            return
        run = RunRepository(self.store).get(row.model_id)
        session = SessionRepository(self.store).get(run.session_id) if run is not None else None
        self.store.add(CheckpointStorageRow(
            storage_id=storage_id(row), tinker_path=row.tinker_path,
            account_id=session.account_id if session is not None else None,
            base_model=run.base_model if run is not None else None,
            size_bytes=row.size_bytes or 0, start_at=row.created_at, end_at=None))


def gb_hour_buckets(intervals: list[Interval], start: datetime, end: datetime, now: datetime) -> list[Bucket]:
    """Hourly buckets of GB-hours within [start, min(end, now)), per (account, base model)."""
    buckets: dict[tuple, Bucket] = {}
    stop = min(end, now)
    for iv in intervals:
        lo = max(iv.start, start)
        hi = min(iv.end or stop, stop)
        hour = lo.replace(minute=0, second=0, microsecond=0)
        while hour < hi:
            a, b = max(lo, hour), min(hi, hour + _HOUR)
            if b > a:
                key = (hour, STORAGE_KIND, iv.account_id, None, iv.base_model)
                gb_hours = iv.size_bytes / BYTES_PER_GB * (b - a).total_seconds() / 3600
                buckets.setdefault(key, Bucket(*key)).quantity += gb_hours
            hour += _HOUR
    return sorted(buckets.values(), key=lambda b: (b.start, -b.quantity))


def storage_cost_usd(gb_hours: float, usd_per_gb_month: float) -> float:
    return usd_per_gb_month * gb_hours / GB_HOURS_PER_GB_MONTH
