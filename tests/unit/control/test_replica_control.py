"""Control in the two replica roles (control/replicas.py, docs/deployment.md) on one store: an api
replica (`engine=None`) stores ops unclaimed and queues nothing; the driver (`worker_id`) claims
them, at start and afterwards, runs them, and stops a sample an api replica's cancel_future names.
The notifications travel through an in-memory bus here; test_notify.py carries them through
PostgreSQL."""

from __future__ import annotations

import pytest

from tests.unit.control.test_cancel import CancellingEngine, finalize
from tests.unit.control.test_scheduler import _wait_done, sample_op, train_op
from tinkerd.artifacts import LocalArtifactStore
from tinkerd.control.control import Control, Work
from tinkerd.control.recovery import Recovery
from tinkerd.control.store.db import Store
from tinkerd.control.store.tables import FutureRow


class Bus:
    """The three channels of store/listen.py, in memory: done wakes the replica, work and cancel
    reach the driver."""

    def __init__(self, hub):
        self.hub = hub
        self.sent: list[tuple] = []
        self.driver: Control | None = None

    def notify(self, request_id, target=None):
        self.hub.notify(request_id, target)

    def work(self):
        self.sent.append(("work",))
        if self.driver is not None:
            self.driver.claimer.wake()

    def cancel(self, request_id):
        self.sent.append(("cancel", request_id))
        self.driver.cancel_id(request_id)

    def publish(self, request_id, deltas):
        self.hub.publish(request_id, deltas)

    def release(self, model_id):
        self.sent.append(("release", model_id))

    def start(self):
        pass

    def close(self):
        pass


def _rebuild(row: FutureRow) -> Work:
    """The recorded op (the seam of Recovery): a sample that decodes long, or an optim_step."""
    return Work(sample_op(max_tokens=1000) if row.request_type == "Sample" else train_op(), finalize)


def test_an_api_replicas_ops_are_claimed_and_run_by_the_driver_and_its_cancel_reaches_it(tmp_path):
    db = tmp_path / "db.sqlite"
    replica = Control(Store.sqlite(db), None)
    bus = Bus(replica.hub)
    replica.use_notifier(bus)
    replica.start()
    before = replica.submit("OptimStep", "m", 1, b"", Work(train_op(), finalize))
    assert bus.sent == [("work",)] and replica.queue.depth() == 0  # stored, not queued
    assert replica.store.get(FutureRow, before.request_id).claimed_by is None
    assert replica.health()["ready"]  # no worker thread, and none expected

    engine = CancellingEngine()
    engine.release_first_step.set()  # the engine holds no step until the sample below
    store = Store.sqlite(db)
    driver = Control(store, engine, Recovery(store, LocalArtifactStore(tmp_path), rebuild=_rebuild), worker_id="w1")
    bus.driver = driver
    driver.start()  # claims `before` at start, with recovery
    try:
        assert _wait_done(driver, before.request_id).status == "complete"
        assert store.get(FutureRow, before.request_id).claimed_by == "w1"
        # After the start: the claimer takes it; the long sample's admission step is held.
        engine.first_step_entered.clear()
        engine.release_first_step.clear()
        running = replica.submit("Sample", "s", 0, b"", Work(sample_op(max_tokens=1000), finalize))
        assert engine.first_step_entered.wait(10)
        assert store.get(FutureRow, running.request_id).claimed_by == "w1"
        replica.cancel(replica.store.get(FutureRow, running.request_id))
        engine.release_first_step.set()
        row = _wait_done(driver, running.request_id)
        assert row.status == "failed" and row.error == "cancelled"
        assert ("cancel", running.request_id) in bus.sent
        # An op the driver accepted itself is claimed at submit: the claimer never takes it again.
        own = driver.submit("OptimStep", "m", 2, b"", Work(train_op(), finalize))
        assert store.get(FutureRow, own.request_id).claimed_by == "w1"
        assert _wait_done(driver, own.request_id).status == "complete"
        assert driver.claimer.claimed == 1  # `running` only: `before` was the start's, `own` the submit's
    finally:
        engine.release_first_step.set()
        driver.stop()
        replica.stop()


def test_the_drivers_quota_pauses_and_queue_depth_are_what_a_replica_reports(tmp_path):
    """An api replica has no queue: retrieve_future's queue_state comes from the reasons the driver's
    board posts (pauses.py), and the back-pressure budget counts the store's pending ops."""
    from tinkerd.control.backpressure import QueueBudget
    from tinkerd.control.pauses import PauseBoard
    from tinkerd.control.queue import OpQueue
    from tinkerd.control.store.futures import FutureRepository
    from tinkerd.errors import QueueFull

    db = tmp_path / "db.sqlite"
    replica = Control(Store.sqlite(db), None)
    replica.use_notifier(Bus(replica.hub))
    replica.budget = QueueBudget(2, None, count=replica.futures.pending_count)
    ids = [replica.submit("OptimStep", "m", i, b"", Work(train_op(), finalize)).request_id for i in (1, 2)]
    # The replica's own queue is empty; the store holds two pending ops of "m".
    with pytest.raises(QueueFull, match="m already has 2 ops waiting"):
        replica.submit("OptimStep", "m", 3, b"", Work(train_op(), finalize))
    replica.submit("OptimStep", "other", 1, b"", Work(train_op(), finalize))  # another target has room

    queue = OpQueue()
    for i, rid in enumerate(ids):
        queue.put(rid, "m", i + 1, "OptimStep", Work(train_op(), finalize))
    reasons = {ids[0]: "account a is over its 40 tokens per minute", ids[1]: None}

    class Scheduler:  # the driver's answer, as scheduler.pause_reason gives it
        def pause_reason(self, request_id):
            return reasons.get(request_id)

    board = PauseBoard(FutureRepository(Store.sqlite(db)), queue, Scheduler())
    assert replica.pause_reason(ids[0]) is None
    assert board.post_once() == 1 and replica.pause_reason(ids[0]) == reasons[ids[0]]
    assert replica.pause_reason(ids[1]) is None
    assert board.post_once() == 0  # nothing changed: nothing written
    reasons[ids[1]] = "account a has 1 of 1 concurrent training runs"
    assert board.post_once() == 1 and replica.pause_reason(ids[1]) == reasons[ids[1]]
    queue.pop("train")  # ids[0] starts: no longer held
    assert board.post_once() == 1 and replica.pause_reason(ids[0]) is None
