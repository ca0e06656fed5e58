"""Only the dead engine recovers: behind an EngineRouter of two engines, a crash of one restarts it
alone, rebuilds only its base model's runs from the log, and re-queues only what it held; the live
engine's adapter, its row decoding and its op of the same step are untouched. Fake engines (no
torch); the real thing through the SDK and Ray is tests/conformance/test_ray_placement.py."""

from __future__ import annotations

import threading

from tinkerd.artifacts import LocalArtifactStore
from tinkerd.control.control import Control, Work
from tinkerd.control.engines import EngineRouter
from tinkerd.control.recovery import Recovery
from tinkerd.control.store.db import Store
from tinkerd.types import AdamParams, CreateModelOp, LoraSpec, OptimStepOp, StepBatch, StepOutput
from tests.unit.control.test_engine_router import _Engine, _sample
from tests.unit.control.test_scheduler import _wait_done


class _DiesOnce(_Engine):
    """Dies the first time it is handed an optim_step, noting what `other` was decoding then; the
    other's rows then finish in 3 more decode steps (they decode until then)."""

    def __init__(self, base: str, other: _Engine):
        super().__init__(base)
        self.other = other
        self.other_decoding_at_death: dict | None = None

    def step(self, batch: StepBatch) -> StepOutput:
        if self.other_decoding_at_death is None and any(isinstance(op, OptimStepOp) for _, op in batch.run):
            self.other_decoding_at_death = dict(self.other.decoding)
            self.other.decoding = {ticket: 3 for ticket in self.other.decoding}
            self.crash_next = True
        return super().step(batch)


def test_a_crash_of_one_engine_rebuilds_and_requeues_only_its_own_work(tmp_path):
    a = _Engine("base-a", rows=10**9)  # a's sample decodes until b died (_DiesOnce)
    b = _DiesOnce("base-b", a)
    works: dict[str, Work] = {}
    recovery = Recovery(Store.sqlite(tmp_path / "db.sqlite"), LocalArtifactStore(tmp_path),
                        rebuild=lambda row: works[row.request_id])
    control = Control(recovery.store, EngineRouter([a, b]), recovery)
    finalize = lambda result: (str(result).encode(), "text/plain")  # noqa: E731

    def submit(rtype: str, target: str, seq: int | None, op) -> str:
        work = Work(op, finalize)
        rid = control.submit(rtype, target, seq, b"", work).request_id
        works[rid] = work
        return rid

    control.start()
    try:
        creates = [submit("CreateModel", m, 0, CreateModelOp(m, base, LoraSpec(4, 8.0)))
                   for m, base in (("ma", "base-a"), ("mb", "base-b"))]
        assert [_wait_done(control, rid).status for rid in creates] == ["complete", "complete"]
        sampled = submit("Sample", "sess-a", None, _sample("base-a"))
        for _ in range(1000):  # a bounded wait until it is admitted: a row of a is in flight when b dies
            if a.decoding:
                break
            threading.Event().wait(0.01)
        steps = [submit("OptimStep", m, 1, OptimStepOp(m, AdamParams(), base_model=base))
                 for m, base in (("ma", "base-a"), ("mb", "base-b"))]
        rows = [_wait_done(control, rid) for rid in steps + [sampled]]
    finally:
        control.stop()
    assert [r.status for r in rows] == ["complete"] * 3, [r.error for r in rows]
    assert b.other_decoding_at_death.get(sampled, 0) > 0  # the sample was mid-decode on a when b died
    # b restarted and got its run back from the log (create again, then its optim_step re-run);
    # a was never restarted, never replayed, and ran its optim_step and admitted its sample once.
    assert (a.restarts, b.restarts) == (0, 1)
    assert [type(op).__name__ for op in b.ran] == ["CreateModelOp", "CreateModelOp", "OptimStepOp"]
    assert [type(op).__name__ for op in a.ran] == ["CreateModelOp", "OptimStepOp"]
    assert sum(ticket == sampled for batch in a.batches for ticket, _ in batch.admit) == 1
    assert rows[2].result == b"base-a:sampled"
