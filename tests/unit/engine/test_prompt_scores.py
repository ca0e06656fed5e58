"""target_prompt_logprobs and prompt_alt_tokens_k (engine/sampler/prompt_scores.py), pinned against
full forwards of the whole prompt (no KV cache, no chunking): the named ids' logprobs at every
position, draws that follow the model's distribution at the request's temperature with their raw
logprobs, reproducible from the seed however the prefill is chunked or packed beside others."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from tests.unit.engine.test_sampler import PROMPT, TINY, Oracle, greedy, op, sampler_adapters, sampler_engine  # noqa: F401
from tests.unit.engine.test_sampler import run_with_slot, slot_of
from tinkerd.engine.sampler.sample import Sampler, SamplerConfig, run_sample
from tinkerd.errors import UserError
from tinkerd.types import SamplingParams

P = len(PROMPT)


def targets(k: int, seed: int = 0) -> np.ndarray:
    ids = np.random.default_rng(seed).integers(0, 151_669, size=(P - 1, k))
    ids[:, 0] = PROMPT[1:]  # the actual next token, so column 0 equals prompt logprobs
    ids[2, 1] = ids[4, 2] = -1  # name nothing
    return ids


def test_target_prompt_logprobs_equal_full_forward(sampler_engine, sampler_adapters):
    oracle = Oracle(sampler_engine, slot_of(sampler_engine, sampler_adapters[1]))
    ids = targets(3)
    o = op(greedy(1), prompt_logprobs=True, prompt_logprobs_last_n=2, target_prompt_ids=ids)
    res = run_with_slot(sampler_engine, sampler_adapters[1], o)
    full = oracle.logprobs(PROMPT.tolist())  # [P, V]: row i predicts token i + 1
    got = res.target_prompt_logprobs
    assert got.shape == (P - 1, 3) and got.dtype == np.float32
    want = full[torch.arange(P - 1)[:, None], torch.from_numpy(np.maximum(ids, 0))].numpy()
    want[ids == -1] = 0.0
    np.testing.assert_allclose(got, want, atol=1e-4)
    assert got[2, 1] == 0.0 and got[4, 2] == 0.0
    # Every position is scored even though prompt logprobs were asked for the last 2 only.
    assert np.isnan(res.prompt_logprobs[:-2]).all()
    np.testing.assert_allclose(res.prompt_logprobs[-2:], got[-2:, 0], atol=1e-5)


def test_alt_tokens_at_temperature_zero_are_the_argmax(sampler_engine):
    res = run_sample(sampler_engine, op(greedy(1), prompt_alt_tokens_k=3))
    ids, lps = res.prompt_alt_tokens
    full = Oracle(sampler_engine).logprobs(PROMPT.tolist())
    assert ids.shape == lps.shape == (P - 1, 3) and ids.dtype == np.int64 and lps.dtype == np.float32
    assert (ids == full[:-1].argmax(-1).numpy()[:, None]).all()
    np.testing.assert_allclose(lps[:, 0], full[:-1].max(-1).values.numpy(), atol=1e-4)


def test_alt_tokens_follow_the_distribution_at_the_request_temperature(sampler_engine):
    k, temperature = 4000, 0.7
    params = SamplingParams(max_tokens=1, temperature=temperature, top_k=5, seed=11)  # top_k does not apply
    res = run_sample(sampler_engine, op(params, prompt=PROMPT[:3], prompt_alt_tokens_k=k))
    ids, lps = res.prompt_alt_tokens
    full = Oracle(sampler_engine).logprobs(PROMPT[:3].tolist())  # [3, V]
    for i in range(2):
        np.testing.assert_allclose(lps[i], full[i, torch.from_numpy(ids[i])].numpy(), atol=1e-4)  # raw logprobs
        probs = torch.softmax(full[i].double() / temperature, -1)
        top = torch.topk(probs, 3)
        for tok, p in zip(top.indices.tolist(), top.values.tolist()):
            freq = float((ids[i] == tok).mean())
            assert abs(freq - p) < 4 * np.sqrt(p * (1 - p) / k) + 1e-3, (i, tok, freq, p)
        assert len(set(ids[i].tolist())) > 5  # more than top_k=5 distinct ids: only temperature applies


def test_alt_tokens_reproduce_from_the_seed_however_the_prefill_runs(sampler_engine):
    params = SamplingParams(max_tokens=2, temperature=1.0, seed=5)
    o = op(params, prompt_alt_tokens_k=6, target_prompt_ids=targets(3))
    alone = run_sample(sampler_engine, o)
    chunked = run_sample(sampler_engine, o, SamplerConfig(prefill_tokens_per_step=3))
    # Packed beside another fresh prompt (prefill.advance_packed).
    sampler = Sampler(sampler_engine.runtime(TINY))
    sampler.admit("other", op(greedy(2), prompt=PROMPT[:5]))
    sampler.admit("this", o)
    packed = {}
    while sampler.active_rows:
        packed.update(sampler.step())
    for res in (chunked, packed["this"]):
        assert (res.prompt_alt_tokens[0] == alone.prompt_alt_tokens[0]).all()
        np.testing.assert_allclose(res.prompt_alt_tokens[1], alone.prompt_alt_tokens[1], atol=1e-4)
        np.testing.assert_allclose(res.target_prompt_logprobs, alone.target_prompt_logprobs, atol=1e-4)
    other_seed = run_sample(sampler_engine, replace(o, params=replace(params, seed=6)))
    assert (other_seed.prompt_alt_tokens[0] != alone.prompt_alt_tokens[0]).any()


@pytest.mark.parametrize("kw, match", [
    (dict(target_prompt_ids=np.zeros((P, 2), dtype=np.int64)), "shape"),
    (dict(target_prompt_ids=np.zeros((P - 1,), dtype=np.int64)), "shape"),
    (dict(target_prompt_ids=np.full((P - 1, 1), 151_669, dtype=np.int64)), "vocabulary"),
    (dict(target_prompt_ids=np.full((P - 1, 1), -2, dtype=np.int64)), "vocabulary"),
    (dict(prompt_alt_tokens_k=-1), "prompt_alt_tokens_k"),
    (dict(prompt_alt_tokens_k=10**7), "prompt_alt_tokens_k"),
])
def test_bad_requests_are_user_errors(sampler_engine, kw, match):
    with pytest.raises(UserError, match=match):
        run_sample(sampler_engine, op(greedy(1), **kw))


def test_single_token_prompt_has_empty_scores(sampler_engine):
    res = run_sample(sampler_engine, op(greedy(1), prompt=PROMPT[:1], prompt_alt_tokens_k=2,
                                        target_prompt_ids=np.zeros((0, 3), dtype=np.int64)))
    assert res.prompt_alt_tokens[0].shape == (0, 2) and res.target_prompt_logprobs.shape == (0, 3)
