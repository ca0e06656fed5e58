"""The prefix cache (sampler/prefix.py): a prompt prefilled once serves later requests with the same
weights and prompt, and what they sample is what they sample without it.

The reference is the same sampler with `prefix_cache=False`, driven through the same schedule, so
the decode batch holds the same rows at every step in both runs. Where the uncached run computes
the same prefill the same way (a request alone in its step), the two must be bit-identical; where
it prefills differently (packed prompts, another chunking), to float rounding.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from tinkerd.engine import checkpoints
from tinkerd.engine.engine import Engine
from tinkerd.engine.sampler.sample import Sampler, SamplerConfig
from tinkerd.types import LoraSpec, SampleResult
from tests.unit.engine.test_sampler_batch import assert_same, drive, op

TINY = "tinkerd/tiny-qwen3"
HYBRID = "tinkerd/tiny-qwen3.5"
SYSTEM = [9707, 11, 1879, 0, 220, 3555, 13, 1416, 2585, 525, 498, 30, 11454, 42, 77, 311, 8, 19]  # 18 ids
PROMPT = SYSTEM + [1000, 2000, 3000]


@pytest.fixture(scope="module")
def eng(models_dir) -> Engine:
    e = Engine(models_dir)
    e.load_base_model(TINY)
    e.load_base_model(HYBRID)
    return e


@pytest.fixture(scope="module")
def paths(eng, tmp_path_factory) -> list[str]:
    """Two sampler checkpoints of adapters with random B (so they change the numbers), saved as
    save_weights_for_sampler does: requests load them through the artifact store and its versions."""
    pool = eng.runtime(TINY).pool
    gen = torch.Generator().manual_seed(11)
    out = []
    for i in range(2):
        a = pool.create(f"prefix-a{i}", LoraSpec(rank=4, alpha=8, seed=40 + i), trainable=True)
        with torch.no_grad():
            for _, b in a.weights.values():
                b.copy_(torch.randn(b.shape, generator=gen) * 0.5)
        out.append(save(eng, f"prefix-a{i}", tmp_path_factory.mktemp("ckpt") / f"s{i}"))
    return out


def save(eng, key: str, path) -> str:
    checkpoints.save_adapter(eng.runtime(TINY).pool.get(key), TINY, str(path), with_optimizer=False)
    return str(path)


def both(eng, schedule, model=TINY, **config) -> tuple[dict, dict, Sampler]:
    """The schedule's results through a sampler with the prefix cache and one without; and the first."""
    cached = Sampler(eng.runtime(model), SamplerConfig(**config))
    plain = Sampler(eng.runtime(model), SamplerConfig(prefix_cache=False, **config))
    return drive(cached, schedule), drive(plain, schedule), cached


def assert_identical(a: SampleResult, b: SampleResult) -> None:
    assert len(a.sequences) == len(b.sequences)
    for x, y in zip(a.sequences, b.sequences):
        assert x.tokens == y.tokens and x.stop_reason == y.stop_reason
        assert x.logprobs == y.logprobs  # bit for bit, not to a tolerance


SEEDED = {"temperature": 1.0, "seed": 5}
GREEDY = {"temperature": 0.0}


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_a_prompt_seen_again_is_not_prefilled_and_samples_bit_identically(eng, params):
    # "b" arrives while "a" decodes and "c" after "a" finished: both are whole-prompt hits.
    schedule = {0: [("a", op(PROMPT, 6, **params))], 3: [("b", op(PROMPT, 6, **params))],
                10: [("c", op(PROMPT, 4, num_samples=2, **params))]}
    cached, plain, sampler = both(eng, schedule)
    for t in "abc":
        assert_identical(cached[t], plain[t])
    assert sampler.prefix.hits == 2 and len(sampler.prefix) == 1
    assert [cached[t].prompt_cache_hit_tokens for t in "abc"] == [0, len(PROMPT), len(PROMPT)]
    assert [plain[t].prompt_cache_hit_tokens for t in "abc"] == [0, 0, 0]


def test_a_group_sent_as_separate_requests_prefills_once(eng, monkeypatch):
    """The cookbook's GRPO group: n requests of num_samples=1 with one prompt, arriving together."""
    calls = []
    real = Sampler._join
    monkeypatch.setattr(Sampler, "_join", lambda self, ready: calls.append([r.prefill.chunk_calls for r in ready])
                        or real(self, ready))
    group = [(f"g{i}", op(PROMPT, 5, temperature=1.0, seed=i)) for i in range(4)] + [("greedy", op(PROMPT, 5, **GREEDY))]
    cached, plain, sampler = both(eng, {0: group})
    # One prefill ran (the leader's); the four followers joined the batch in the same step from it.
    assert calls[0] == [[len(PROMPT)], [], [], [], []]
    assert sampler.prefix.hits == 4
    assert [cached[t].prompt_cache_hit_tokens for t, _ in group] == [0] + [len(PROMPT)] * 4
    for t, _ in group:  # uncached, the five prompts were packed into one forward: rounding apart
        assert_same(cached[t], plain[t])
    # Bit for bit what one request of num_samples=4 gives: the same prefill copied into the same rows.
    one = drive(Sampler(eng.runtime(TINY), SamplerConfig(prefix_cache=False)), {0: [("n", op(PROMPT, 5, num_samples=4, **GREEDY))]})
    group = drive(Sampler(eng.runtime(TINY)), {0: [(f"g{i}", op(PROMPT, 5, **GREEDY)) for i in range(4)]})
    for i in range(4):
        assert_identical(group[f"g{i}"], replace(one["n"], sequences=[one["n"].sequences[i]]))


def test_a_shared_system_prompt_is_prefilled_once(eng):
    other = SYSTEM + [4000, 5000, 6000, 7000]
    schedule = {0: [("a", op(PROMPT, 5, **SEEDED))], 8: [("b", op(other, 5, **SEEDED))]}
    cached, plain, sampler = both(eng, schedule)
    assert sampler.prefix.prefix_hits == 1 and len(sampler.prefix) == 2
    assert cached["b"].prompt_cache_hit_tokens == len(SYSTEM)
    assert_identical(cached["a"], plain["a"])
    assert_same(cached["b"], plain["b"])  # its last 4 tokens ran as a chunk after the 18 kept ones


def test_a_chunk_after_kept_columns_reads_them_with_grouped_heads_to_the_bit(eng, monkeypatch):
    """A prompt's chunk over the prefix cache's kept columns (more keys than queries, under a mask)
    reads them with the key/value heads grouped (engine/causal.py), not widened to the query heads
    as HF's call does; what it samples is bit for bit what the widened call gives."""
    from transformers.integrations import sdpa_attention as hf

    from tinkerd.engine import causal

    widened = []
    real = hf.repeat_kv
    monkeypatch.setattr(hf, "repeat_kv", lambda x, n: widened.append(tuple(x.shape)) or real(x, n))
    other = SYSTEM + [4000, 5000, 6000, 7000]
    schedule = {0: [("a", op(PROMPT, 5, **SEEDED))], 8: [("b", op(other, 5, **SEEDED))]}
    grouped = drive(Sampler(eng.runtime(TINY), SamplerConfig()), schedule)
    assert grouped["b"].prompt_cache_hit_tokens == len(SYSTEM)
    assert [s for s in widened if s[2] > len(SYSTEM)] == []
    monkeypatch.setattr(causal, "_reads_cached_prefix", lambda *a: False)  # HF's widened call
    wide = drive(Sampler(eng.runtime(TINY), SamplerConfig()), schedule)
    assert any(s[2] == len(other) for s in widened)
    for t in "ab":
        assert_identical(grouped[t], wide[t])


def test_no_reuse_across_adapters(eng, paths):
    schedule = {0: [("a", op(PROMPT, 6, paths[0], **SEEDED))], 8: [("b", op(PROMPT, 6, paths[1], **SEEDED))],
                16: [("base", op(PROMPT, 6, **SEEDED))], 24: [("a2", op(PROMPT, 6, paths[0], **SEEDED))]}
    cached, plain, sampler = both(eng, schedule)
    for t in ("a", "b", "base", "a2"):
        assert_identical(cached[t], plain[t])
    assert cached["a"].sequences[0].tokens != cached["b"].sequences[0].tokens  # the adapters do differ
    assert sampler.prefix.hits == 1 and len(sampler.prefix) == 3  # only a2 reused (a's)


def test_new_sampler_weights_at_the_same_path_are_not_served_from_the_old_prefill(eng, paths, tmp_path):
    rt = eng.runtime(TINY)
    path = save(eng, "prefix-a0", tmp_path / "s")
    cached = Sampler(rt)
    before = drive(cached, {0: [("before", op(PROMPT, 6, path, **SEEDED))]})
    save(eng, "prefix-a1", path)  # save_weights_for_sampler again under the same name: new weights
    after = drive(cached, {0: [("after", op(PROMPT, 6, path, **SEEDED))]})
    assert cached.prefix.hits == 0 and len(cached.prefix) == 1  # the old weights' entry is gone
    plain = Sampler(rt, SamplerConfig(prefix_cache=False))
    assert_identical(after["after"], drive(plain, {0: [("x", op(PROMPT, 6, path, **SEEDED))]})["x"])
    assert after["after"].sequences[0].tokens != before["before"].sequences[0].tokens


def test_requests_asking_for_prompt_scores_are_prefilled(eng):
    schedule = {0: [("a", op(PROMPT, 3, **GREEDY))], 6: [("b", op(PROMPT, 3, prompt_logprobs=True, **GREEDY))]}
    cached, plain, sampler = both(eng, schedule)
    assert sampler.prefix.hits == 0
    assert_identical(cached["b"], plain["b"])
    np.testing.assert_array_equal(cached["b"].prompt_logprobs, plain["b"].prompt_logprobs)


def test_entries_give_way_to_rows_within_the_kv_budget(eng):
    rt = eng.runtime(TINY)
    from tinkerd.engine.sampler.kv import kv_bytes_per_token

    per_token = kv_bytes_per_token(rt.model.config, torch.float32)
    # Room for 8 rows of PROMPT + 10 tokens: "wide" takes all of it (its prompt copied into each
    # row: share_prompts=False), so the kept prompt must go.
    sampler = Sampler(rt, SamplerConfig(kv_cache_bytes=8 * (len(PROMPT) + 10) * per_token, share_prompts=False))
    drive(sampler, {0: [("a", op(PROMPT, 4))]})
    assert len(sampler.prefix) == 1 and sampler.prefix.nbytes == len(PROMPT) * per_token
    got = drive(sampler, {0: [("wide", op(SYSTEM + [1, 2, 3], 10, num_samples=8))]})
    assert len(got["wide"].sequences) == 8
    assert len(sampler.prefix) == 0 and sampler.prefix.nbytes == 0


def test_hybrid_models_reuse_whole_prompts_only(eng):
    schedule = {0: [("a", op(PROMPT, 5, **SEEDED))], 8: [("b", op(PROMPT, 5, **SEEDED))],
                16: [("c", op(SYSTEM + [4000, 5000], 5, **SEEDED))]}
    schedule = {s: [(t, replace(o, base_model=HYBRID)) for t, o in reqs] for s, reqs in schedule.items()}
    cached, plain, sampler = both(eng, schedule, model=HYBRID)
    for t in "abc":
        assert_identical(cached[t], plain[t])
    assert sampler.prefix.hits == 1 and sampler.prefix.prefix_hits == 0  # a recurrent state cannot be cut


def test_followers_of_a_cancelled_request_prefill_themselves(eng):
    rt = eng.runtime(TINY)
    sampler = Sampler(rt, SamplerConfig(prefill_tokens_per_step=8))  # PROMPT takes 3 steps
    for t in ("lead", "f1", "f2"):
        sampler.admit(t, op(PROMPT, 4, **GREEDY))
    sampler.step()
    assert [r.leader is not None for r in sampler.joining] == [False, True, True]
    got = dict(sampler.cancel("lead"))
    for _ in range(20):  # bounded: followers left waiting on a gone leader would never finish
        got.update(sampler.step())
    assert not sampler.active_rows
    assert got["lead"].message.startswith("cancelled")
    want = drive(Sampler(rt, SamplerConfig(prefix_cache=False)), {0: [("x", op(PROMPT, 4, **GREEDY))]})["x"]
    assert_same(got["f1"], want)
    assert_same(got["f2"], want)
