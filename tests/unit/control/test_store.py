"""The store on both backends (a real PostgreSQL, tests/postgres.py): what the rest of control relies
on — the column types' ranges, JSON and bytes, naive UTC datetimes, the unique dedupe key under a
race, and that PostgreSQL runs transactions side by side where SQLite takes them one at a time."""

from __future__ import annotations

import threading
from datetime import datetime

import pytest

from tinkerd.control.store.db import Store, utcnow
from tinkerd.control.store.tables import FutureRow, SessionRow
from tinkerd.errors import UserError


def _future(request_id: str, dedupe_key: str | None = None, seq_id: int | None = 0, body: bytes = b"x") -> FutureRow:
    return FutureRow(request_id=request_id, request_type="ForwardBackward", target="m", seq_id=seq_id,
                     dedupe_key=dedupe_key, account_id="a", body=body, op_version=1, status="pending",
                     created_at=utcnow())


def test_values_round_trip(db_url):
    store = Store(db_url)
    raw = bytes(range(256)) * 3  # every byte value, NULs included
    assert store.add(_future("r1", seq_id=2**63 - 1, body=raw))
    assert store.add(_future("r2", seq_id=-(2**63)))
    at = datetime(2026, 12, 2, 5, 30, 1, 123456)
    meta = {"nested": {"list": [1, 2.5, None, "é"]}, "big": 2**62}
    assert store.add(SessionRow(session_id="s", account_id="a", created_at=at, last_heartbeat_at=at,
                                tags=["t", "ü"], user_metadata=meta))
    assert store.get(FutureRow, "r1").seq_id == 2**63 - 1
    assert store.get(FutureRow, "r1").body == raw
    assert store.get(FutureRow, "r2").seq_id == -(2**63)
    s = store.get(SessionRow, "s")
    assert s.created_at == at and s.created_at.tzinfo is None
    assert (s.tags, s.user_metadata) == (["t", "ü"], meta)
    store.update(FutureRow, "r1", status="complete", result=b"\x00\x01")
    assert store.get(FutureRow, "r1").result == b"\x00\x01"
    store.delete(FutureRow, "r2")
    assert store.get(FutureRow, "r2") is None


def test_duplicate_keys_are_refused_not_raised(db_url):
    store = Store(db_url)
    assert store.add(_future("r1", dedupe_key="k"))
    assert not store.add(_future("r1"))  # primary key
    assert not store.add(_future("r2", dedupe_key="k"))  # unique dedupe key
    assert store.future_by_dedupe_key("k").request_id == "r1"


def test_racing_inserts_of_one_dedupe_key_admit_exactly_one(db_url):
    # Control.submit's idempotency: two replicas (or threads) storing the same (target, seq_id) at
    # once; the database's unique constraint decides, and the loser hears False, not an exception.
    store = Store(db_url)
    barrier, won = threading.Barrier(8), []

    def add(i: int) -> None:
        barrier.wait()
        won.append(store.add(_future(f"r{i}", dedupe_key="same")))

    threads = [threading.Thread(target=add, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(won) == [False] * 7 + [True]


def test_postgresql_runs_writers_side_by_side_and_sqlite_one_at_a_time(db_url):
    # While one multi-statement write transaction is open, another call either completes (PostgreSQL:
    # no process-wide lock, row-level conflicts only) or waits for it (SQLite's single writer).
    store = Store(db_url)
    inside, release, other_done = threading.Event(), threading.Event(), threading.Event()

    def long_write() -> None:
        with store.write() as s:
            s.add(_future("held"))
            s.flush()
            inside.set()
            release.wait(10)

    t = threading.Thread(target=long_write)
    t.start()
    inside.wait(10)
    other = threading.Thread(target=lambda: (store.add(_future("other")), other_done.set()))
    other.start()
    finished_while_held = other_done.wait(1.0)
    release.set()
    t.join()
    other.join()
    assert finished_while_held == db_url.startswith("postgresql")
    assert store.get(FutureRow, "held") and store.get(FutureRow, "other")


def test_a_value_postgresql_refuses_is_the_callers_error_not_a_crash(db_url):
    # A NUL in text: SQLite stores it; PostgreSQL refuses it, which must read as a `user` error (400).
    store = Store(db_url)
    at = utcnow()
    row = SessionRow(session_id="s\x00", account_id="a", created_at=at, last_heartbeat_at=at, tags=[], user_metadata={})
    if store.sqlite:
        assert store.add(row) and store.get(SessionRow, "s\x00") is not None
        return
    with pytest.raises(UserError, match="cannot contain NUL"):
        store.add(row)
    with pytest.raises(UserError, match="cannot contain NUL"):
        store.get(FutureRow, "r\x00")
