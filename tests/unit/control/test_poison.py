"""An op that kills the engine process is failed once it has killed it again running alone; the
ops in flight beside it, and everything queued, still run. A SIGKILL from outside (an operator, a
chaos test) suspects nobody. No torch: a fake engine that dies as a process would."""

from __future__ import annotations

import numpy as np
import pytest

from tinkerd.control.control import Control, Work
from tinkerd.control.store.db import Store
from tinkerd.control.store.tables import FutureRow
from tinkerd.errors import EngineCrashed
from tinkerd.types import AdamParams, OptimStepOp, SampleOp, SamplingParams, StepBatch, StepOutput
from tests.unit.control.test_scheduler import FakeEngine, _wait_done

POISON = "poison"  # the base model / model_id of ops that kill the engine


class DyingEngine(FakeEngine):
    """FakeEngine (samples finish `max_tokens` decode steps after admission) whose step dies, losing
    every row in flight, when it admits or runs a POISON op (the first `deaths_left` times)."""

    def __init__(self, self_inflicted: bool, deaths_left: int = 10**9):
        super().__init__()
        self.release_first_step.set()  # no test here holds the first step
        self.self_inflicted = self_inflicted
        self.deaths_left = deaths_left
        self.deaths: list[int] = []  # index into steps of each death
        self.decoding: list[list[str]] = []  # tickets decoding when each step began

    def step(self, batch: StepBatch) -> StepOutput:
        self.decoding.append(sorted(self.inflight))
        ops = [op for _, op in batch.run + batch.admit]
        if self.deaths_left > 0 and any((getattr(op, "base_model", "") or getattr(op, "model_id", None)) == POISON for op in ops):
            self.deaths_left -= 1
            self.steps.append(batch)
            self.deaths.append(len(self.steps) - 1)
            self.inflight.clear()
            raise EngineCrashed("engine process 1 died of SIGSEGV", self_inflicted=self.self_inflicted)
        return super().step(batch)

    def restart(self) -> float:
        return 0.0


def sample(base_model: str, max_tokens: int = 3) -> Work:
    op = SampleOp(base_model, None, np.array([1, 2]), SamplingParams(max_tokens=max_tokens))
    return Work(op, lambda r: (str(r).encode(), "text/plain"))


def optim(model_id: str) -> Work:
    return Work(OptimStepOp(model_id, AdamParams()), lambda r: (str(r).encode(), "text/plain"))


def run(tmp_path, engine: DyingEngine, works: dict[str, tuple[str, str, Work]]) -> dict[str, FutureRow]:
    """Queue every op before the worker starts (so the first sampling step admits them together)."""
    control = Control(Store.sqlite(tmp_path / "db.sqlite"), engine)
    ids = {name: control.submit(rtype, target, 0, b"", work).request_id for name, (rtype, target, work) in works.items()}
    control.start()
    try:
        return {name: _wait_done(control, rid) for name, rid in ids.items()}
    finally:
        control.stop()


def test_an_op_that_kills_the_engine_is_failed_and_the_ops_beside_it_finish(tmp_path):
    engine = DyingEngine(self_inflicted=True)
    works = {
        "a": ("Sample", "sess-a", sample("m", 4)),
        "poison": ("Sample", "sess-p", sample(POISON)),
        "b": ("Sample", "sess-b", sample("m", 2)),
        "train": ("OptimStep", "model-1", optim("model-1")),
    }
    rows = run(tmp_path, engine, works)
    failed = rows.pop("poison")
    assert failed.status == "failed" and failed.error_category == "user"
    assert "died of SIGSEGV" in failed.error and "the last time alone" in failed.error
    for name, row in rows.items():
        assert row.status == "complete", (name, row.error)
    # First death: the poison was admitted with a and b. The three, suspects once, were admitted
    # together again, apart from everything else: second death. Then one at a time: the third death
    # was the poison's alone, and it was not run a fourth time.
    first, second, third = engine.deaths
    assert len(engine.steps[first].admit) == 3 and len(engine.steps[second].admit) == 3
    alone = engine.steps[third]
    assert len(alone.admit) == 1 and not alone.run and not engine.decoding[third]
    assert all(len(s.admit) <= 1 for s in engine.steps[second + 1:])
    assert engine.deaths_left > 0


def test_a_suspect_that_runs_alone_without_dying_completes(tmp_path):
    engine = DyingEngine(self_inflicted=True, deaths_left=1)  # it died once, of something passing
    rows = run(tmp_path, engine, {"p": ("Sample", "sess-p", sample(POISON)), "a": ("Sample", "sess-a", sample("m"))})
    assert [r.status for r in rows.values()] == ["complete", "complete"]
    assert rows["p"].result == f"sampled {rows['p'].request_id}".encode()


@pytest.mark.parametrize("kind", ["Sample", "OptimStep"])
def test_a_kill_from_outside_suspects_nobody(tmp_path, kind):
    # Killed from outside 3 times with the op in flight, beside another: run again each time, batched
    # as before (no isolation), and it completes.
    engine = DyingEngine(self_inflicted=False, deaths_left=3)
    work = sample(POISON) if kind == "Sample" else optim(POISON)
    rows = run(tmp_path, engine, {"p": (kind, "t-p", work), "a": ("Sample", "sess-a", sample("m", 6))})
    assert [r.status for r in rows.values()] == ["complete", "complete"]
    assert len(engine.deaths) == 3
