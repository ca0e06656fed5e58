"""Streaming requests in the engine (SampleOp.stream): every step reports each of their rows' new
token (StepOutput.partial), and those tokens joined are exactly the finished result's tokens,
logprobs and top-k; requests that do not stream report nothing, and streaming changes no token."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from tinkerd.engine.engine import Engine
from tinkerd.engine.sampler.sample import run_sample
from tinkerd.types import SampleOp, SamplingParams, StepBatch

TINY = "tinkerd/tiny-qwen3"
PROMPT = [9707, 11, 1879, 0, 220, 3555, 13, 1416, 2585, 525, 498, 30, 11454]


@pytest.fixture(scope="module")
def eng(models_dir) -> Engine:
    e = Engine(models_dir)
    e.load_base_model(TINY)
    return e


def test_stream_reports_each_step_and_joins_to_the_result(eng):
    live = SampleOp(TINY, None, np.array(PROMPT, dtype=np.int64),
                    SamplingParams(max_tokens=9, temperature=0.8, seed=5, stop_at_eos=False), num_samples=2,
                    topk_sample_logprobs=3, stream=True)
    quiet = dataclasses.replace(live, prompt=live.prompt[:6], stream=False)
    alone = run_sample(eng, dataclasses.replace(live, stream=False))
    out = eng.step(StepBatch(admit=[("live", live), ("quiet", quiet)], decode=True))
    seen: dict[int, list] = {0: [], 1: []}
    done: dict = {}
    steps = 0
    while True:
        for ticket, result in out.done:
            done[ticket] = result
        assert {t for t, _ in out.partial} <= {"live"}  # the other request reports nothing
        for ticket, deltas in out.partial:
            assert sorted(d.row for d in deltas) == [0, 1]  # one token per row per step
            for d in deltas:
                assert d.start == len(seen[d.row]) and len(d.tokens) == 1
                seen[d.row].append(d)
        if "live" in done and "quiet" in done:
            break
        steps += 1
        assert steps < 50
        out = eng.step(StepBatch(decode=True))
    for row, (seq, ref) in enumerate(zip(done["live"].sequences, alone.sequences)):
        assert seq.tokens == ref.tokens  # streaming changes nothing sampled
        assert [t for d in seen[row] for t in d.tokens] == seq.tokens
        assert [lp for d in seen[row] for lp in d.logprobs] == seq.logprobs
        np.testing.assert_array_equal(np.concatenate([d.topk[0] for d in seen[row]]), seq.topk_logprobs[0])
        np.testing.assert_array_equal(np.concatenate([d.topk[1] for d in seen[row]]), seq.topk_logprobs[1])
