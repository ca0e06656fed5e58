"""Usage and cost of one account over a window, in total and per training run, for the console.

No pricing of its own: the same metered rows (control/metering.py), hourly buckets, storage ledger
(control/storage.py) and ServerConfig prices as GET /api/v1/billing/usage/events, so the console's
numbers are the SDK's `get_billing_usage` summed (tests/e2e/test_console.py checks they are equal).

Per run: the tokens of its own ops (trained, forward), of the samplers that sample its checkpoints
or its inflight target (prefill, sampled), and the GB-hours of its checkpoints. Usage that belongs
to no run (sampling a base model) is listed as such.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime

from tinkerd.config import ServerConfig
from tinkerd.control.metering import TOKEN_KINDS, Meter, hourly_buckets
from tinkerd.control.storage import STORAGE_KIND, Interval, StorageLedger, gb_hour_buckets, storage_cost_usd
from tinkerd.control.store.db import Store
from tinkerd.control.store.checkpoints import CheckpointStorageRepository
from tinkerd.control.store.runs import RunRepository
from tinkerd.control.store.sampling import SamplingSessionRepository
from tinkerd.control.store.usage import UsageRepository

# The SDK's billing event type of each metered kind, and storage.
KINDS = (*TOKEN_KINDS, STORAGE_KIND)


@dataclass
class Costed:
    """Quantities by kind (a UsageRecord token field, or storage_gb_hours) and their estimated cost."""

    quantities: dict[str, float] = field(default_factory=lambda: dict.fromkeys(KINDS, 0))
    checkpoints: int = 0

    def cost_usd(self, config: ServerConfig) -> dict[str, float]:
        out = {k: config.token_price_usd_per_mtok(k) * self.quantities[k] / 1e6 for k in TOKEN_KINDS}
        out[STORAGE_KIND] = storage_cost_usd(self.quantities[STORAGE_KIND], config.price_storage_usd_per_gb_month)
        return out

    def total_usd(self, config: ServerConfig) -> float:
        return sum(self.cost_usd(config).values())


def prices(config: ServerConfig) -> dict[str, float]:
    """The prices in force: USD per million tokens of each kind, and per GB-month of storage."""
    return {**{k: config.token_price_usd_per_mtok(k) for k in TOKEN_KINDS},
            STORAGE_KIND: config.price_storage_usd_per_gb_month}


def account_usage(store: Store, meter: Meter, ledger: StorageLedger, account_id: str, start: datetime,
                  end: datetime, now: datetime) -> Costed:
    """The account's usage in [start, end): the billing events' quantities, summed."""
    ledger.sync(now)
    out = Costed()
    for b in hourly_buckets(meter.rows(account_id, start, end)):
        if b.kind == "checkpoints":
            out.checkpoints += int(b.quantity)
        else:
            out.quantities[b.kind] += b.quantity
    for b in gb_hour_buckets(ledger.intervals(account_id, start, end), start, end, now):
        out.quantities[STORAGE_KIND] += b.quantity
    return out


def run_usage(store: Store, ledger: StorageLedger, account_id: str, start: datetime, end: datetime,
              now: datetime) -> dict[str | None, Costed]:
    """model_id -> the run's usage in [start, end) (None: usage of no run); sums in SQL, grouped by target."""
    ledger.sync(now)
    by_target = UsageRepository(store).sums_by_target(account_id, start, end, tuple(TOKEN_KINDS))
    run_ids = set(RunRepository(store).ids_of_account(account_id))
    samplers = {sid: inflight or _run_of_path(path)
                for sid, path, inflight in SamplingSessionRepository(store).runs_of_account(account_id)}
    storage = CheckpointStorageRepository(store).started_before(account_id, end)
    out: dict[str | None, Costed] = {}
    for target, checkpoints, tokens in by_target:
        run = target if target in run_ids else samplers.get(target, _run_of_path(target))
        costed = out.setdefault(run if run in run_ids else None, Costed())
        costed.checkpoints += int(checkpoints)
        for k, n in zip(TOKEN_KINDS, tokens):
            costed.quantities[k] += int(n)
    intervals: dict[str | None, list[Interval]] = {}
    for r in storage:
        run = _run_of_path(r.tinker_path)
        intervals.setdefault(run if run in run_ids else None, []).append(
            Interval(r.account_id, r.base_model, r.size_bytes, r.start_at, r.end_at))
    for run, ivs in intervals.items():
        gb_hours = sum(b.quantity for b in gb_hour_buckets(ivs, start, end, now))
        if gb_hours:
            out.setdefault(run, Costed()).quantities[STORAGE_KIND] += gb_hours
    return out


def _run_of_path(path: str | None) -> str | None:
    """The training run of a tinker:// path (`tinker://<run>/<type>/<name>`), or None."""
    if not path or not path.startswith("tinker://"):
        return None
    return path.removeprefix("tinker://").split("/", 1)[0]
