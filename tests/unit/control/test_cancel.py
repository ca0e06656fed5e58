"""Control.cancel (cancel_future): a queued sampling request is taken out and failed without reaching
the engine, its outcome stored by the worker thread like every other op's (retrying storage faults,
waking an idle worker); one in the engine has its ticket handed over with the next step; others are
refused."""

from __future__ import annotations

import threading

import pytest

from tests.unit.control.test_results import FlakyCommits
from tests.unit.control.test_scheduler import FakeEngine, _wait_done, sample_op, train_op
from tinkerd.control.control import Control, Work
from tinkerd.control.store.db import Store
from tinkerd.control.store.tables import FutureRow
from tinkerd.errors import UserError
from tinkerd.types import StepBatch, StepOutput


class CancellingEngine(FakeEngine):
    def step(self, batch: StepBatch) -> StepOutput:
        out = super().step(batch)
        for ticket in batch.cancel:
            if self.inflight.pop(ticket, None) is not None:
                out.done.append((ticket, UserError("cancelled")))
        out.active_rows = len(self.inflight)
        return out


@pytest.fixture
def control(tmp_path):
    engine = CancellingEngine()
    c = Control(Store.sqlite(tmp_path / "db.sqlite"), engine)
    c.start()
    yield c, engine
    engine.release_first_step.set()
    c.stop()


def finalize(result):
    return str(result).encode(), "text/plain"


def test_queued_and_in_flight_samples_are_stopped_and_other_requests_refused(control):
    c, engine = control
    running = c.submit("Sample", "s", 0, b"", Work(sample_op(max_tokens=1000), finalize))
    assert engine.first_step_entered.wait(10)  # `running` is in the engine; the first step is held
    queued = c.submit("Sample", "s", 1, b"", Work(sample_op(max_tokens=3), finalize))
    trained = c.submit("OptimStep", "m", 0, b"", Work(train_op(), finalize))
    c.cancel(c.store.get(FutureRow, queued.request_id))
    with pytest.raises(UserError, match="only sampling requests"):
        c.cancel(c.store.get(FutureRow, trained.request_id))
    c.cancel(c.store.get(FutureRow, running.request_id))
    engine.release_first_step.set()
    row = _wait_done(c, running.request_id)
    assert row.status == "failed" and row.error == "cancelled"
    assert len(engine.steps) < 1000  # it did not decode to its end
    row = _wait_done(c, queued.request_id)
    assert row.status == "failed" and row.error_category == "user" and "before it started" in row.error
    assert all(queued.request_id not in [t for t, _ in s.admit] for s in engine.steps)
    assert _wait_done(c, trained.request_id).status == "complete"
    c.cancel(c.store.get(FutureRow, running.request_id))  # finished: nothing happens


def _writers(c: Control, request_id: str) -> list[tuple[str, dict]]:
    """(thread name, values) of every store update of `request_id`'s FutureRow, as they are attempted."""
    seen, update = [], c.store.update

    def recording(table, key, **values):
        if table is FutureRow and key == request_id:
            seen.append((threading.current_thread().name, values))
        return update(table, key, **values)

    c.store.update = recording
    return seen


def test_a_queued_cancel_is_stored_by_the_worker_which_retries_a_storage_fault(control):
    c, engine = control
    c.submit("Sample", "s", 0, b"", Work(sample_op(max_tokens=2), finalize))
    assert engine.first_step_entered.wait(10)  # the worker is in the engine; `queued` waits behind it
    queued = c.submit("Sample", "s", 1, b"", Work(sample_op(max_tokens=3), finalize))
    writes = _writers(c, queued.request_id)
    flaky = FlakyCommits(c.store)
    flaky.fail = 2  # the disk is full: the next two commits fail
    c.cancel(c.store.get(FutureRow, queued.request_id))
    # The API thread stored nothing and met no fault: the outcome is the worker's to store.
    assert writes == [] and flaky.failed == 0
    engine.release_first_step.set()
    row = _wait_done(c, queued.request_id)
    assert row.status == "failed" and row.error_category == "user" and "before it started" in row.error
    assert flaky.failed == 2  # both faults met by the worker, which retried until the write landed
    assert {name for name, _ in writes} == {"tinkerd-engine"} and len(writes) == 3
    assert all(queued.request_id not in [t for t, _ in s.admit] for s in engine.steps)


class PausedQuotas:
    """Every op is over its account's quota: the scheduler passes over all of them and sleeps."""

    def new_pass(self) -> None:
        pass

    def pause_reason(self, *args, **kwargs) -> str:
        return "over quota"

    def recheck_s(self) -> float:
        return 30.0  # longer than the test's waits: only the cancel can wake the worker

    def on_usage(self, *args) -> None:
        pass


def test_a_cancel_wakes_a_worker_sleeping_on_paused_work_without_an_engine_step(tmp_path):
    engine = CancellingEngine()
    engine.release_first_step.set()
    c = Control(Store.sqlite(tmp_path / "db.sqlite"), engine, quotas=PausedQuotas())
    c.start()
    try:
        paused = c.submit("Sample", "s", 0, b"", Work(sample_op(max_tokens=3), finalize))
        c.cancel(c.store.get(FutureRow, paused.request_id))
        row = _wait_done(c, paused.request_id)
        assert row.status == "failed" and row.error_category == "user" and "before it started" in row.error
        assert engine.steps == []  # nothing was handed to the engine, not even an empty step
    finally:
        c.stop()
