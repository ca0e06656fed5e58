"""EngineRouter (control/engines.py) over fake engines: routing by base model, the single-engine
pass-through, release merging, sampling rows, and a crash of one engine restarting it alone."""

import threading

import numpy as np
import pytest

from tinkerd.control.engines import EngineRouter, EnginesCrashed, run_ops
from tinkerd.errors import EngineCrashed, NotFoundError, UserError
from tinkerd.types import (AdamParams, CreateModelOp, ForwardBackwardOp, LoraSpec, OptimStepOp, ReleaseAdaptersOp,
                           Resident, SampleOp, SamplingParams, ServedModel, StepBatch, StepOutput)


class _Engine:
    """Serves `bases`; records what it ran; a sample takes `rows` decode steps."""

    def __init__(self, *bases: str, rows: int = 2):
        self.bases, self.rows = bases, rows
        self.ran: list = []
        self.batches: list[StepBatch] = []
        self.held: set[str] = set()
        self.decoding: dict[str, int] = {}
        self.restarts = 0
        self.crash_next = False
        self.barrier: threading.Barrier | None = None

    def models(self):
        return [ServedModel(b, b, 64, "fake") for b in self.bases]

    def step(self, batch: StepBatch) -> StepOutput:
        self.batches.append(batch)
        if self.barrier is not None:  # both engines inside step at once, or this times out
            self.barrier.wait(timeout=5)
        if self.crash_next:
            self.crash_next = False
            raise EngineCrashed("engine died")
        done = []
        for ticket, op in batch.run:
            self.ran.append(op)
            if isinstance(op, CreateModelOp):
                self.held.add(op.model_id)
            if isinstance(op, ReleaseAdaptersOp):
                gone = [m for m, _ in op.models if m != "pinned" or m not in self.held]
                self.held -= set(gone)
                done.append((ticket, {"unloaded": gone, "sampler_paths": [p for p in op.sampler_paths if p in self.bases]}))
            else:
                done.append((ticket, f"{self.bases[0]}:{type(op).__name__}"))
        for ticket, _ in batch.admit:
            self.decoding[ticket] = self.rows
        for ticket in batch.cancel:
            if self.decoding.pop(ticket, None) is not None:
                done.append((ticket, UserError("cancelled")))
        if batch.decode:
            for ticket in list(self.decoding):
                self.decoding[ticket] -= 1
                if self.decoding[ticket] == 0:
                    del self.decoding[ticket]
                    done.append((ticket, f"{self.bases[0]}:sampled"))
        return StepOutput(done, active_rows=len(self.decoding),
                          resident=Resident(training=len(self.held), sampler_paths=(self.bases[0],)))

    def restart(self) -> float:
        self.restarts += 1
        self.held.clear()
        self.decoding.clear()
        return 0.0

    def close(self):
        pass


def _sample(base: str) -> SampleOp:
    return SampleOp(base, None, np.array([1, 2]), SamplingParams(max_tokens=2))


def test_one_engine_is_passed_through_unchanged():
    engine = _Engine("a", "b")
    router = EngineRouter([engine])
    batch = StepBatch(run=[("t1", OptimStepOp("m", AdamParams()))], decode=True)
    out = router.step(batch)
    assert engine.batches == [batch]  # the very batch: no split, no copy, no routing
    assert out.done == [("t1", "a:OptimStepOp")]
    assert router.models() == engine.models()


def test_ops_go_to_the_engine_of_their_base_model():
    a, b = _Engine("base-a"), _Engine("base-b")
    router = EngineRouter([a, b])
    out = router.step(StepBatch(run=[("1", CreateModelOp("ma", "base-a", LoraSpec(4, 8.0))),
                                     ("2", CreateModelOp("mb", "base-b", LoraSpec(4, 8.0)))]))
    assert sorted(out.done) == [("1", "base-a:CreateModelOp"), ("2", "base-b:CreateModelOp")]
    out = router.step(StepBatch(run=[("3", OptimStepOp("mb", AdamParams(), base_model="base-b"))]))
    assert out.done == [("3", "base-b:OptimStepOp")]
    # A record from before ops carried their base model: routed by the run's create op.
    out = router.step(StepBatch(run=[("4", ForwardBackwardOp("ma", [], "cross_entropy"))]))
    assert out.done == [("4", "base-a:ForwardBackwardOp")]
    assert [type(op).__name__ for op in a.ran] == ["CreateModelOp", "ForwardBackwardOp"]
    assert [type(op).__name__ for op in b.ran] == ["CreateModelOp", "OptimStepOp"]
    assert out.resident.training == 2  # each engine's last report, summed


def test_an_op_that_cannot_be_routed_fails_alone():
    a, b = _Engine("base-a"), _Engine("base-b")
    router = EngineRouter([a, b])
    out = router.step(StepBatch(run=[("1", OptimStepOp("nobody", AdamParams())),
                                     ("2", CreateModelOp("mc", "base-c", LoraSpec(4, 8.0))),
                                     ("3", CreateModelOp("ma", "base-a", LoraSpec(4, 8.0)))]))
    done = dict(out.done)
    assert isinstance(done["1"], NotFoundError) and "nobody" in done["1"].message
    assert isinstance(done["2"], UserError) and "base-c" in done["2"].message and "base-a" in done["2"].message
    assert done["3"] == "base-a:CreateModelOp"


def test_two_engines_step_at_the_same_time():
    a, b = _Engine("base-a"), _Engine("base-b")
    a.barrier = b.barrier = threading.Barrier(2)  # each waits for the other inside step
    router = EngineRouter([a, b])
    out = router.step(StepBatch(run=[("1", CreateModelOp("ma", "base-a", LoraSpec(4, 8.0))),
                                     ("2", CreateModelOp("mb", "base-b", LoraSpec(4, 8.0)))]))
    assert len(out.done) == 2


def test_sampling_rows_cancel_and_decode_reach_the_engine_holding_them():
    a, b = _Engine("base-a", rows=1), _Engine("base-b", rows=3)
    router = EngineRouter([a, b])
    out = router.step(StepBatch(admit=[("s1", _sample("base-a")), ("s2", _sample("base-b")),
                                       ("s3", _sample("base-b"))], decode=True))
    assert out.done == [("s1", "base-a:sampled")] and out.active_rows == 2
    out = router.step(StepBatch(cancel=["s3"], decode=True))
    assert [t for t, _ in out.done] == ["s3"] and out.active_rows == 1
    assert len(a.batches) == 1
    out = router.step(StepBatch(decode=True))
    assert out.done == [("s2", "base-b:sampled")] and out.active_rows == 0


def test_a_release_reaches_every_engine_and_counts_a_run_only_when_all_released_it():
    a, b = _Engine("base-a"), _Engine("base-b")
    router = EngineRouter([a, b])
    run_ops(router, [CreateModelOp("pinned", "base-b", LoraSpec(4, 8.0)), CreateModelOp("ma", "base-a", LoraSpec(4, 8.0))])
    (result,) = run_ops(router, [ReleaseAdaptersOp(models=[("ma", None), ("pinned", None)],
                                                   sampler_paths=["base-a", "base-b", "elsewhere"])])
    # b keeps "pinned" (its snapshot could not be written, say): not released, though a never held it.
    assert result == {"unloaded": ["ma"], "sampler_paths": ["base-a", "base-b"]}


def test_a_crash_of_one_engine_loses_only_its_work_and_restart_restarts_it_alone():
    a, b = _Engine("base-a", rows=3), _Engine("base-b", rows=3)
    router = EngineRouter([a, b])
    run_ops(router, [CreateModelOp("ma", "base-a", LoraSpec(4, 8.0)), CreateModelOp("mb", "base-b", LoraSpec(4, 8.0))])
    router.step(StepBatch(admit=[("sa", _sample("base-a")), ("sb", _sample("base-b"))], decode=True))
    b.crash_next = True
    with pytest.raises(EnginesCrashed) as crash:
        router.step(StepBatch(run=[("1", OptimStepOp("ma", AdamParams(), base_model="base-a")),
                                   ("2", OptimStepOp("mb", AdamParams(), base_model="base-b"))], decode=True))
    # b's op and its row are lost; a's op finished and its row decodes on.
    assert crash.value.base_models == {"base-b"} and crash.value.lost == {"2", "sb"}
    assert crash.value.output.done == [("1", "base-a:OptimStepOp")] and crash.value.output.active_rows == 1
    router.restart()
    assert (a.restarts, b.restarts) == (0, 1) and a.held == {"ma"} and not b.held
    out = router.step(StepBatch(decode=True))
    assert out.done == [("sa", "base-a:sampled")]
    assert run_ops(router, [CreateModelOp("mb", "base-b", LoraSpec(4, 8.0))]) == ["base-b:CreateModelOp"]
    router.restart()  # nothing known dead: every engine (a crash reported by something else)
    assert (a.restarts, b.restarts) == (1, 2)


def test_a_restart_that_fails_names_what_is_still_down():
    a, b = _Engine("base-a"), _Engine("base-b")
    router = EngineRouter([a, b])
    b.crash_next = True
    with pytest.raises(EnginesCrashed):
        router.step(StepBatch(run=[("1", CreateModelOp("mb", "base-b", LoraSpec(4, 8.0)))]))
    b.restart = lambda: (_ for _ in ()).throw(EngineCrashed("did not start"))
    with pytest.raises(EnginesCrashed) as crash:
        router.restart()
    assert crash.value.base_models == {"base-b"} and a.restarts == 0


def test_control_trains_two_base_models_in_the_same_step(tmp_path):
    from tinkerd.control.control import Control, Work
    from tinkerd.control.store.db import Store
    from tests.unit.control.test_scheduler import _wait_done

    a, b = _Engine("base-a"), _Engine("base-b")
    a.barrier = b.barrier = threading.Barrier(2)  # a step that reaches only one engine times out and fails
    control = Control(Store.sqlite(tmp_path / "db.sqlite"), EngineRouter([a, b]))
    finalize = lambda result: (str(result).encode(), "text/plain")  # noqa: E731
    ids = [control.submit("OptimStep", model, 0, b"", Work(OptimStepOp(model, AdamParams(), base_model=base), finalize))
           .request_id for model, base in (("ma", "base-a"), ("mb", "base-b"))]
    control.start()
    try:
        rows = [_wait_done(control, rid) for rid in ids]
    finally:
        control.stop()
    assert [r.status for r in rows] == ["complete", "complete"], [r.error for r in rows]
    assert len(a.batches) == len(b.batches) == 1  # one step carried both


def test_with_one_engine_a_training_step_carries_one_op(tmp_path):
    from tinkerd.control.control import Control, Work
    from tinkerd.control.store.db import Store
    from tests.unit.control.test_scheduler import _wait_done

    engine = _Engine("base-a", "base-b")
    control = Control(Store.sqlite(tmp_path / "db.sqlite"), EngineRouter([engine]))
    finalize = lambda result: (str(result).encode(), "text/plain")  # noqa: E731
    ids = [control.submit("OptimStep", model, 0, b"", Work(OptimStepOp(model, AdamParams(), base_model=base), finalize))
           .request_id for model, base in (("ma", "base-a"), ("mb", "base-b"))]
    control.start()
    try:
        [_wait_done(control, rid) for rid in ids]
    finally:
        control.stop()
    assert [len(batch.run) for batch in engine.batches] == [1, 1]
