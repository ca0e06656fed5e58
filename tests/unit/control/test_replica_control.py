"""Control in the two replica roles (control/replicas.py, docs/deployment.md) on one store: an api
replica (`engine=None`) stores ops unclaimed and queues nothing; the driver (`worker_id`) claims
them, at start and afterwards, runs them, and stops a sample an api replica's cancel_future names.
The notifications travel through an in-memory bus here; test_notify.py carries them through
PostgreSQL."""

from __future__ import annotations

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
