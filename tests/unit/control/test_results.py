"""A finished op whose result cannot be stored (disk full, I/O error, database locked) is retried
until it lands, and nothing runs ahead of it; new work is refused under the free-space reserve with
a 503 that names the cause. No torch: a fake engine, a store whose commits fail on demand."""

from __future__ import annotations

import logging
import sqlite3
import threading
import time

import pytest
from sqlalchemy.exc import OperationalError

from tinkerd.control.control import Control, Work
from tinkerd.control.diskspace import DiskReserve
from tinkerd.control.store.db import Store, utcnow
from tinkerd.control.store.tables import FutureRow, SessionRow
from tinkerd.errors import StorageUnavailable
from tinkerd.types import AdamParams, OptimStepOp, StepBatch, StepOutput
from tests.unit.control.test_scheduler import _wait_done


class FlakyCommits:
    """Makes the store's next `fail` commits raise SQLite's "database or disk is full"."""

    def __init__(self, store: Store):
        self.fail = 0
        self.failed = 0
        inner = store._sessions

        def session():
            s = inner()
            commit = s.commit

            def flaky_commit():
                if self.fail > 0:
                    self.fail -= 1
                    self.failed += 1
                    raise OperationalError("COMMIT", {}, sqlite3.OperationalError("database or disk is full"))
                return commit()

            s.commit = flaky_commit
            return s

        store._sessions = session


class RecordingEngine:
    """Runs training ops at once; notes, as each op runs, the stored status of the ops before it."""

    def __init__(self, store: Store):
        self.store = store
        self.ran: list[tuple[str, list[str]]] = []
        self.order: list[str] = []

    def step(self, batch: StepBatch) -> StepOutput:
        for ticket, _ in batch.run:
            self.ran.append((ticket, [self.store.get(FutureRow, t).status for t in self.order]))
            self.order.append(ticket)
        return StepOutput([(t, {"loss": 1.0}) for t, _ in batch.run], active_rows=0)

    def models(self):
        return []

    def close(self):
        pass


def optim() -> Work:
    return Work(OptimStepOp("model-1", AdamParams()), lambda r: (repr(r).encode(), "text/plain"))


def _until(predicate, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition never held"
        time.sleep(0.01)


def test_a_result_that_cannot_be_stored_is_retried_and_nothing_runs_ahead_of_it(tmp_path, caplog):
    store = Store.sqlite(tmp_path / "db.sqlite")
    engine = RecordingEngine(store)
    control = Control(store, engine)
    ids = [control.submit("OptimStep", "model-1", seq, b"", optim()).request_id for seq in (1, 2, 3)]
    flaky = FlakyCommits(store)
    flaky.fail = 10**9  # the disk is full until the test frees it
    caplog.set_level(logging.WARNING, logger="tinkerd.control.results")
    control.start()
    try:
        _until(lambda: flaky.failed >= 5)  # retried with back-off, the worker blocked on it
        assert [rid for rid, _ in engine.ran] == ids[:1]  # seq 2 and 3 wait behind the unstored result
        health = control.health()
        assert not health["ready"] and "a finished op's result cannot be stored" in health["reasons"]
        flaky.fail = 0  # space is back: no restart needed
        rows = [_wait_done(control, rid) for rid in ids]
    finally:
        control.stop()
    assert [r.status for r in rows] == ["complete"] * 3
    assert rows[0].result == repr({"loss": 1.0}).encode()  # stored once, as the engine returned it
    # Each op ran once, in order, and only after every result before it was stored.
    assert engine.ran == [(ids[0], []), (ids[1], ["complete"]), (ids[2], ["complete", "complete"])]
    # Said once when it stalled and once when it recovered, not per attempt.
    # Only this module's records: SDK clients other tests left open log heartbeat warnings meanwhile.
    ours = [r for r in caplog.records if r.name == "tinkerd.control.results"]
    errors = [r for r in ours if r.levelno == logging.ERROR]
    recovered = [r for r in ours if r.levelno == logging.WARNING]
    assert len(errors) == 1 and "database or disk is full" in errors[0].getMessage()
    assert len(recovered) == 1 and "failed attempts" in recovered[0].getMessage()
    assert control.results.stalled_since is None


def test_a_few_failed_commits_cost_a_short_retry(tmp_path):
    store = Store.sqlite(tmp_path / "db.sqlite")
    control = Control(store, RecordingEngine(store))
    rid = control.submit("OptimStep", "model-1", 1, b"", optim()).request_id
    flaky = FlakyCommits(store)
    flaky.fail = 3
    control.start()
    try:
        row = _wait_done(control, rid)
    finally:
        control.stop()
    assert row.status == "complete" and flaky.failed == 3 and control.results.stalls == 1


def test_stopping_during_the_stall_leaves_the_op_pending_for_the_restart(tmp_path):
    store = Store.sqlite(tmp_path / "db.sqlite")
    engine = RecordingEngine(store)
    control = Control(store, engine)
    rid = control.submit("OptimStep", "model-1", 1, b"", optim()).request_id
    flaky = FlakyCommits(store)
    flaky.fail = 10**9
    control.start()
    _until(lambda: flaky.failed >= 2)
    t0 = time.monotonic()
    control.stop()
    assert time.monotonic() - t0 < 5  # the worker gave up the write instead of holding the stop
    flaky.fail = 0
    # Pending in the log: the next start rebuilds the adapter without it and runs it again (recovery.py).
    assert store.get(FutureRow, rid).status == "pending"


def test_the_store_names_a_failed_write_instead_of_a_bare_operational_error(tmp_path):
    store = Store.sqlite(tmp_path / "db.sqlite")
    FlakyCommits(store).fail = 1
    with pytest.raises(StorageUnavailable) as info:
        store.add(SessionRow(session_id="s", created_at=utcnow(), last_heartbeat_at=utcnow()))
    assert info.value.status_code == 503 and info.value.category == "server"
    assert "server storage is failing: database or disk is full" in info.value.message
    assert info.value.headers == {"Retry-After": "10"}


def test_new_work_is_refused_under_the_reserve_and_a_resend_is_not(tmp_path, caplog):
    store = Store.sqlite(tmp_path / "db.sqlite")
    reserve = DiskReserve(tmp_path, reserve_bytes=0)
    control = Control(store, RecordingEngine(store), reserve=reserve)
    first = control.submit("OptimStep", "model-1", 1, b"", optim())
    caplog.set_level(logging.WARNING, logger="tinkerd.control.diskspace")
    reserve._reserve_bytes = 10**18  # more than any disk has
    for _ in range(3):
        with pytest.raises(StorageUnavailable) as info:
            control.submit("OptimStep", "model-1", 2, b"", optim())
    assert info.value.status_code == 503 and info.value.message.startswith("server storage is full: ")
    assert str(tmp_path) in info.value.message and "reserve" in info.value.message
    # A re-send of an accepted op is no new work: it gets its original future back.
    again = control.submit("OptimStep", "model-1", 1, b"", optim())
    assert again.request_id == first.request_id and not again.new
    health = control.health()
    assert health["storage"]["ok"] is False and health["storage"]["reserve_bytes"] == 10**18
    reserve._reserve_bytes = 0
    assert control.submit("OptimStep", "model-1", 2, b"", optim()).new
    assert control.health()["storage"]["ok"] is True
    levels = [r.levelno for r in caplog.records if r.name == "tinkerd.control.diskspace"]
    assert levels == [logging.ERROR, logging.WARNING]  # once when full, once when recovered


def test_the_default_reserve_is_a_gib_or_five_percent_of_a_small_disk(tmp_path):
    state = DiskReserve(tmp_path).state()
    assert state.reserve_bytes == min(2**30, int(state.total_bytes * 0.05))
