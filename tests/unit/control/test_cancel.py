"""Control.cancel (cancel_future): a queued sampling request is taken out and failed without reaching
the engine; one in the engine has its ticket handed over with the next step; others are refused."""

from __future__ import annotations

import pytest

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
    row = c.store.get(FutureRow, queued.request_id)
    assert row.status == "failed" and row.error_category == "user" and "before it started" in row.error
    with pytest.raises(UserError, match="only sampling requests"):
        c.cancel(c.store.get(FutureRow, trained.request_id))
    c.cancel(c.store.get(FutureRow, running.request_id))
    engine.release_first_step.set()
    row = _wait_done(c, running.request_id)
    assert row.status == "failed" and row.error == "cancelled"
    assert len(engine.steps) < 1000  # it did not decode to its end
    assert all(queued.request_id not in [t for t, _ in s.admit] for s in engine.steps)
    assert _wait_done(c, trained.request_id).status == "complete"
    c.cancel(c.store.get(FutureRow, running.request_id))  # finished: nothing happens
