"""cancel_future in the engine: a cancelled request leaves the decode batch (or its prefill) at once,
comes back failed as cancelled, and the requests beside it compute exactly what they compute alone."""

from __future__ import annotations

import numpy as np
import pytest

from tinkerd.engine.engine import Engine
from tinkerd.engine.sampler.sample import Sampler, run_sample
from tinkerd.errors import UserError
from tinkerd.types import SampleOp, SamplingParams, StepBatch

TINY = "tinkerd/tiny-qwen3"
PROMPT = [9707, 11, 1879, 0, 220, 3555, 13, 1416, 2585, 525, 498, 30, 11454]


@pytest.fixture(scope="module")
def eng(models_dir) -> Engine:
    e = Engine(models_dir)
    e.load_base_model(TINY)
    return e


def op(prompt, max_tokens, **kw) -> SampleOp:
    n = kw.pop("num_samples", 1)
    return SampleOp(TINY, None, np.array(prompt, dtype=np.int64),
                    SamplingParams(max_tokens=max_tokens, stop_at_eos=False, **kw), num_samples=n)


def test_a_request_cancelled_mid_decode_leaves_and_the_others_are_unchanged(eng):
    keep_a, gone, keep_b = op(PROMPT[:4], 12, seed=1, num_samples=2), op(PROMPT, 40, seed=2, num_samples=3), \
        op(PROMPT[2:9], 10, temperature=0.0)
    alone = {"a": run_sample(eng, keep_a), "b": run_sample(eng, keep_b)}
    sampler = Sampler(eng.runtime(TINY))
    for ticket, o in (("a", keep_a), ("gone", gone), ("b", keep_b)):
        sampler.admit(ticket, o)
    results: dict[str, object] = {}
    for _ in range(3):  # prefill, then two tokens each: all three decode in one batch
        results.update(sampler.step())
    assert sampler.active_rows == 6
    cancelled = sampler.cancel("gone")
    assert [t for t, _ in cancelled] == ["gone"] and isinstance(cancelled[0][1], UserError)
    assert "cancelled" in cancelled[0][1].message
    assert sampler.active_rows == 3 and sampler.cancel("gone") == [] and sampler.cancel("unknown") == []
    while sampler.active_rows:
        results.update(sampler.step())
    for ticket in ("a", "b"):
        for got, ref in zip(results[ticket].sequences, alone[ticket].sequences):
            assert got.tokens == ref.tokens
            np.testing.assert_allclose(got.logprobs, ref.logprobs, atol=1e-4)


def test_a_request_cancelled_while_prefilling_and_the_last_one_of_a_batch(eng):
    sampler = Sampler(eng.runtime(TINY))
    sampler.admit("x", op(PROMPT, 5))
    assert sampler.cancel("x")[0][0] == "x" and sampler.active_rows == 0  # never prefilled
    sampler.admit("y", op(PROMPT, 30))
    sampler.step()
    sampler.step()
    assert sampler.cancel("y")[0][0] == "y" and sampler.active_rows == 0 and sampler.step() == []
    # The emptied batch takes new work as a fresh one.
    sampler.admit("z", op(PROMPT[:5], 6, temperature=0.0))
    got = {}
    while sampler.active_rows:
        got.update(sampler.step())
    assert got["z"].sequences[0].tokens == run_sample(eng, op(PROMPT[:5], 6, temperature=0.0)).sequences[0].tokens


def test_engine_step_cancels_after_admitting(eng):
    """A cancel for a ticket admitted in the same step (the client gave up at once) still stops it."""
    out = eng.step(StepBatch(admit=[("now", op(PROMPT, 20))], decode=True, cancel=["now", "never-seen"]))
    assert [t for t, _ in out.done] == ["now"] and isinstance(out.done[0][1], UserError) and out.active_rows == 0
