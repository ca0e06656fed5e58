"""GB-hour checkpoint storage billing against a hand computation, with fixed times."""

from __future__ import annotations

from datetime import datetime

import pytest

from tinkerd.control.storage import StorageLedger, gb_hour_buckets, storage_cost_usd
from tinkerd.control.store.db import Store
from tinkerd.control.store.tables import CheckpointRow, SessionRow, TrainingRunRow


def at(h: int, m: int = 0) -> datetime:
    return datetime(2026, 3, 1, h, m)


@pytest.fixture
def ledger(tmp_path):
    store = Store.sqlite(tmp_path / "db.sqlite")
    for acct in ("acct-a", "acct-b"):
        store.add(SessionRow(session_id=f"s-{acct}", account_id=acct, created_at=at(0), last_heartbeat_at=at(0)))
        store.add(TrainingRunRow(model_id=f"m-{acct}", session_id=f"s-{acct}", base_model="tiny", lora_rank=4,
                                 lora_config={"rank": 4}, created_at=at(0), last_request_at=at(0)))
    return StorageLedger(store)


def ckpt(ledger: StorageLedger, acct: str, name: str, size: int, created: datetime, expires: datetime | None = None):
    row = CheckpointRow(tinker_path=f"tinker://m-{acct}/weights/{name}", model_id=f"m-{acct}", checkpoint_type="training",
                        name=name, dir_path="/nowhere", created_at=created, expires_at=expires, size_bytes=size)
    ledger.store.add(row)
    return row


def test_gb_hours_by_hour_match_a_hand_computation(ledger):
    # A: 2.5 GB from 10:30, deleted at 12:15; 1 GB from 11:45 with a TTL ending 12:10 (not yet swept).
    a1 = ckpt(ledger, "acct-a", "a1", 2_500_000_000, at(10, 30))
    ckpt(ledger, "acct-a", "a2", 1_000_000_000, at(11, 45), expires=at(12, 10))
    # B: 4 GB from 11:00, still stored when read at 12:30.
    ckpt(ledger, "acct-b", "b1", 4_000_000_000, at(11))
    ledger.sync(now=at(11, 50))  # a read while all three live
    ledger.removed(a1, now=at(12, 15))
    ledger.store.delete(CheckpointRow, a1.tinker_path)
    now = at(12, 30)
    ledger.sync(now)
    a = {b.start.hour: b.quantity for b in gb_hour_buckets(ledger.intervals("acct-a", at(0), at(23)), at(0), at(23), now)}
    # 10:00  a1 2.5 GB x 0.5 h                  = 1.25
    # 11:00  a1 2.5 x 1 h + a2 1 GB x 0.25 h    = 2.75
    # 12:00  a1 2.5 x 0.25 h + a2 1 x 10/60 h   = 0.625 + 0.1667
    assert a == pytest.approx({10: 1.25, 11: 2.75, 12: 0.625 + 1 / 6})
    b = gb_hour_buckets(ledger.intervals("acct-b", at(0), at(23)), at(0), at(23), now)
    assert [(x.start.hour, x.quantity, x.base_model, x.session_id) for x in b] == [(11, 4.0, "tiny", None), (12, 2.0, "tiny", None)]
    # A window cuts intervals: [11:00, 12:00) holds only hour 11.
    cut = gb_hour_buckets(ledger.intervals("acct-a", at(11), at(12)), at(11), at(12), now)
    assert [(x.start.hour, x.quantity) for x in cut] == [(11, pytest.approx(2.75))]
    # A GB-month is 720 GB-hours: 7.2 GB-hours at $10 per GB-month cost $0.10.
    assert storage_cost_usd(7.2, 10.0) == pytest.approx(0.10)


def test_an_overwrite_ends_the_old_registration_and_starts_a_new_one(ledger):
    old = ckpt(ledger, "acct-a", "w", 1_000_000_000, at(9))
    ledger.removed(old, now=at(9, 30))  # what Checkpoints.register_checkpoint does on overwrite=True
    ledger.store.delete(CheckpointRow, old.tinker_path)
    ckpt(ledger, "acct-a", "w", 3_000_000_000, at(9, 30))
    now = at(10)
    ledger.sync(now)
    got = gb_hour_buckets(ledger.intervals("acct-a", at(0), at(23)), at(0), at(23), now)
    assert [(x.start.hour, x.quantity) for x in got] == [(9, pytest.approx(1 * 0.5 + 3 * 0.5))]


def test_checkpoints_from_before_the_ledger_are_picked_up_when_usage_is_read(ledger):
    ckpt(ledger, "acct-b", "legacy", 2_000_000_000, at(8))  # no interval opened when it was saved
    now = at(9, 30)
    ledger.sync(now)
    got = gb_hour_buckets(ledger.intervals("acct-b", at(0), at(23)), at(0), at(23), now)
    assert [(x.start.hour, x.quantity) for x in got] == [(8, 2.0), (9, 1.0)]
