"""The scheduler's policy (fair share of engine time, row budget, round-robin) and the control
worker loop that steps the engine while sampling rows are in flight. No torch: a fake engine."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from tinkerd.control.control import Control, Work
from tinkerd.control.queue import OpQueue
from tinkerd.control.scheduler import LANE_SAMPLE, LANE_TRAIN, Scheduler
from tinkerd.control.store.db import Store
from tinkerd.control.store.tables import FutureRow
from tinkerd.errors import UserError
from tinkerd.types import OptimStepOp, AdamParams, SampleOp, SamplingParams, StepBatch, StepOutput


def sample_op(n: int = 1, max_tokens: int = 3) -> SampleOp:
    return SampleOp("m", None, np.array([1, 2]), SamplingParams(max_tokens=max_tokens), num_samples=n)


def train_op() -> OptimStepOp:
    return OptimStepOp("m", AdamParams())


def put(q: OpQueue, rid: str, target: str, seq: int | None, op) -> None:
    q.put(rid, target, seq, type(op).__name__, Work(op, lambda r: (b"", "x")), lane=Scheduler.lane_of(op))


def test_the_control_plane_queue_files_each_op_in_its_lane_by_itself(tmp_path):
    q = Control(Store.sqlite(tmp_path / "db.sqlite"), engine=None).queue
    q.put("s", "session", 0, "Sample", Work(sample_op(), lambda r: (b"", "x")))  # no lane given
    q.put("t", "model", 0, "OptimStep", Work(train_op(), lambda r: (b"", "x")))
    assert q.pop(LANE_SAMPLE).request_id == "s" and q.pop(LANE_TRAIN).request_id == "t"


def test_both_lanes_busy_share_engine_time_evenly():
    """A 1 s training op is followed by 1 s of 0.25 s decode steps, then the next training op."""
    q = OpQueue()
    for i in range(3):
        put(q, f"t{i}", "model", i, train_op())
    sched = Scheduler(q)
    lanes = []
    for _ in range(14):
        picked = sched.next(active_rows=4)
        lanes.append("T" if picked.lane == LANE_TRAIN else "s")
        sched.charge(picked, 1.0 if picked.lane == LANE_TRAIN else 0.25)
    assert "".join(lanes) == "TssssTssssTsss"


def test_an_idle_lane_banks_no_credit():
    q = OpQueue()
    sched = Scheduler(q)
    for _ in range(100):  # sampling alone for 100 s: training was idle, so it earns nothing
        picked = sched.next(active_rows=2)
        assert picked.lane == LANE_SAMPLE
        sched.charge(picked, 1.0)
    put(q, "t0", "model", 0, train_op())
    put(q, "t1", "model", 1, train_op())
    order = []
    for _ in range(4):
        picked = sched.next(active_rows=2)
        order.append(picked.lane)
        sched.charge(picked, 1.0)
    # Not 100 s of training in a row: the two lanes alternate from the moment training has work.
    assert order == [LANE_TRAIN, LANE_SAMPLE, LANE_TRAIN, LANE_SAMPLE]


def test_sampling_admits_round_robin_within_the_row_budget():
    q = OpQueue()
    put(q, "a0", "session-a", 0, sample_op(n=3))
    put(q, "a1", "session-a", 1, sample_op(n=1))
    put(q, "b0", "session-b", 0, sample_op(n=2))
    sched = Scheduler(q, max_rows=4)
    first = sched.next(active_rows=0)
    assert [o.request_id for o in first.ops] == ["a0"]  # b0 is next in turn and does not fit (3 + 2 > 4)
    assert first.batch.decode and [t for t, _ in first.batch.admit] == ["a0"]
    assert sched.next(active_rows=3).ops == []  # still full: decode only
    assert [o.request_id for o in sched.next(active_rows=0).ops] == ["b0", "a1"]
    # More samples than the budget still run, alone, once the batch is empty.
    put(q, "big", "session-c", 0, sample_op(n=9))
    assert sched.next(active_rows=1).ops == []
    assert [o.request_id for o in sched.next(active_rows=0).ops] == ["big"]


def test_training_ops_run_in_seq_order_per_model_and_rotate_across_models():
    q = OpQueue()
    put(q, "m1-s1", "m1", 1, train_op())
    put(q, "m1-s0", "m1", 0, train_op())
    put(q, "m2-s0", "m2", 0, train_op())
    sched = Scheduler(q)
    got = [sched.next(active_rows=0).ops[0].request_id for _ in range(3)]
    assert got == ["m1-s0", "m2-s0", "m1-s1"]


def test_a_closed_queue_ends_the_loop_even_with_rows_in_flight():
    q = OpQueue()
    q.close()
    assert Scheduler(q).next(active_rows=0) is None
    assert Scheduler(q).next(active_rows=5) is None


class FakeEngine:
    """Sampling requests finish `max_tokens` decode steps after admission; training ops at once."""

    def __init__(self):
        self.steps: list[StepBatch] = []
        self.inflight: dict[str, int] = {}
        self.first_step_entered = threading.Event()
        self.release_first_step = threading.Event()

    def step(self, batch: StepBatch) -> StepOutput:
        self.first_step_entered.set()
        self.release_first_step.wait(10)  # holds the first step while the test queues more work
        self.steps.append(batch)
        done = [(t, f"ran {type(op).__name__}") for t, op in batch.run]
        for ticket, op in batch.admit:
            if op.prompt.size == 0:
                done.append((ticket, UserError("prompt is empty")))
            else:
                self.inflight[ticket] = op.params.max_tokens
        if batch.decode:
            for ticket in list(self.inflight):
                self.inflight[ticket] -= 1
                if self.inflight[ticket] == 0:
                    del self.inflight[ticket]
                    done.append((ticket, f"sampled {ticket}"))
        return StepOutput(done, active_rows=len(self.inflight))

    def models(self):
        return []

    def close(self):
        pass


@pytest.fixture
def control(tmp_path):
    engine = FakeEngine()
    c = Control(Store.sqlite(tmp_path / "db.sqlite"), engine)
    c.start()
    yield c, engine
    engine.release_first_step.set()
    c.stop()


def _wait_done(control: Control, request_id: str) -> FutureRow:
    for _ in range(1000):  # a bounded wait on the worker thread, not a timing assertion
        row = control.store.get(FutureRow, request_id)
        if row.status != "pending":
            return row
        threading.Event().wait(0.01)
    raise AssertionError(f"{request_id} never finished")


def test_worker_steps_while_rows_are_in_flight_and_runs_training_in_between(control):
    c, engine = control
    finalize = lambda result: (str(result).encode(), "text/plain")  # noqa: E731
    sampled = c.submit("Sample", "session", 0, b"", Work(sample_op(max_tokens=5), finalize))
    assert engine.first_step_entered.wait(10)  # the request is in the engine, decoding
    bad = c.submit("Sample", "session", 1, b"", Work(SampleOp("m", None, np.array([]), SamplingParams(max_tokens=2)), finalize))
    trained = c.submit("OptimStep", "model", 0, b"", Work(train_op(), finalize))
    engine.release_first_step.set()
    row = _wait_done(c, sampled.request_id)
    assert row.status == "complete" and row.result == f"sampled {sampled.request_id}".encode()
    assert _wait_done(c, trained.request_id).result == b"ran OptimStepOp"
    failed = _wait_done(c, bad.request_id)
    assert failed.status == "failed" and failed.error_category == "user" and "empty" in failed.error
    kinds = ["run" if s.run else "decode" for s in engine.steps]
    # The training op ran between decode steps of the in-flight request, not after it finished.
    first_decode = kinds.index("decode")
    assert first_decode < kinds.index("run") < len(kinds) - 1
    assert kinds.count("decode") == 5 and not engine.inflight
    assert c._inflight == {}
