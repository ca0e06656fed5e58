"""Shared prompts in the decode batch (sampler/shared.py): rows of one prompt read its keys and
values from one copy, and compute what they compute from their own copies.

The reference is the same batch with every row's prompt copied into its own columns (the cache
without segments, `SamplerConfig(share_prompts=False)`): the two differ only in summation order, so
hidden states agree to float rounding and the chosen tokens are the same.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tinkerd.engine.sampler import sample as sample_mod
from tinkerd.engine.sampler.adapters import split_model
from tinkerd.engine.sampler.decode import FusedDecode
from tinkerd.engine.sampler.kv import BatchCache
from tinkerd.engine.sampler.prefill import Prefill
from tinkerd.engine.sampler.sample import Sampler, SamplerConfig
from tinkerd.errors import UserError
from tinkerd.types import SampleOp, SamplingParams
from tests.unit.engine.test_sampler_batch import assert_same, drive
# The fast paths' engine: both test architectures, each with adapters -a0 and -a1 of random B.
from tests.unit.engine.test_sampler_fast_paths import MODELS, PROMPTS, eng  # noqa: F401 (a fixture)


def prefilled(rt, body, prompt) -> Prefill:
    pf = Prefill.start(np.array(prompt), rt.model.config, torch.device("cpu"), False, 0, None)
    rt.ctx.set_single(-1)
    pf.advance(body, None, len(prompt))
    return pf


@pytest.mark.parametrize("name", MODELS)
def test_rows_of_a_shared_prompt_step_as_rows_with_their_own_copies(eng, name):
    """Joins, steps and leaving rows on a shared cache and a copying one: equal hidden states at
    every step, while the shared one holds each multi-row prompt once and drops it with its last row."""
    rt = eng.runtime(name)
    body, _ = split_model(rt.model)
    step = FusedDecode.build(body)
    gen = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        pfs = [prefilled(rt, body, p) for p in PROMPTS]
        shared, copied = BatchCache(len(body.layers), shared=True), BatchCache(len(body.layers))
        # pf0 three times (one request's num_samples), pf1 once, pf2 as a leader and a follower.
        first = [(pfs[0].cache, 3), (pfs[1].cache, 1), (pfs[2].cache, 1), (pfs[2].cache, 1)]
        schedule = {0: ("join", first), 2: ("keep", [0, 2, 3, 5]), 3: ("join", [(pfs[1].cache, 2)]),
                    5: ("keep", [2, 3, 4, 5]), 7: ("keep", [0, 2, 3])}
        segments, widths = [], []
        for t in range(9):
            what, arg = schedule.get(t, (None, None))
            for cache in (shared, copied):
                if what == "join":
                    cache.join(arg, [16] * len(arg))  # 9 steps: every row's tokens fit
                elif what:
                    cache.keep(arg)
            segments.append(shared.shared.count)
            widths.append((shared.width, copied.width))
            tokens = torch.randint(0, 500, (shared.rows,), generator=gen)
            rt.ctx.set_rows([-1] * shared.rows)
            rt.ctx.sampling = True
            try:
                outs = []
                for cache in (shared, copied):
                    positions, mask = cache.step_inputs()
                    outs.append(step(tokens, positions, mask, cache, adapters=False))
                    cache.advance()
            finally:
                rt.ctx.sampling = False
                rt.ctx.clear()
            torch.testing.assert_close(outs[0], outs[1], atol=1e-5, rtol=1e-5)
            assert torch.equal(shared.lengths, copied.lengths)
    # pf0 and pf2 shared from the start; pf1's second join adds one; pf0's last row leaves at step 5,
    # pf2's at step 7.
    assert segments == [2, 2, 2, 3, 3, 2, 2, 1, 1]
    # Own columns: pf1's single row keeps its prompt there (3 prompt + t generated); the segments'
    # rows only what they generated, where the copying cache is as wide as its longest prompt's row.
    assert [w for w, _ in widths] == [len(PROMPTS[1]) + t for t in range(9)]
    assert [c for _, c in widths[:5]] == [len(PROMPTS[2]) + t for t in range(5)]


def group_schedule(name, adapter):
    def op(prompt, max_tokens, n=1, **kw):
        params = SamplingParams(max_tokens=max_tokens, stop_at_eos=False, **kw)
        return SampleOp(name, adapter, np.array(prompt, dtype=np.int64), params, num_samples=n)

    return {
        0: [("n4", op(PROMPTS[0], 8, n=4, temperature=1.0, seed=3)), ("one", op(PROMPTS[1], 5, temperature=0.0))],
        2: [(f"g{i}", op(PROMPTS[2], 6 + i, temperature=1.0, seed=10 + i)) for i in range(3)]
           + [("n2", op(PROMPTS[1], 4, n=2, temperature=0.0))],
        5: [("late", op(PROMPTS[0], 3, n=3, temperature=1.0, seed=9))],
    }


@pytest.mark.parametrize("adapter", [False, True], ids=["base", "adapter"])
@pytest.mark.parametrize("name", MODELS)
def test_num_samples_and_followed_groups_sample_what_copied_prompts_sample(eng, name, adapter, monkeypatch):
    """num_samples rows, a cookbook group (three requests, one prefill), a late request of a prompt
    seen before (a prefix-cache hit, copied again), with rows leaving at different steps and one
    request cancelled mid-decode: the same tokens and logprobs as with every prompt copied."""
    monkeypatch.setattr(sample_mod, "acquire_adapter", lambda rt, path, max_idle: rt.pool.acquire(path) if path else None)
    schedule = group_schedule(name, f"{name}-a0" if adapter else None)
    seen = {True: [], False: []}

    def run(share: bool):
        sampler = Sampler(eng.runtime(name), SamplerConfig(share_prompts=share))

        def on_step(t, s):
            seen[share].append((s.cache.shared.count if s.cache.shared is not None else 0, s.kv_cache_bytes()))
            if t == 4:
                assert s.cancel("g1")  # one follower of the group leaves its segment early

        return drive(sampler, schedule, on_step)

    got, want = run(True), run(False)
    assert set(got) == set(want) == {"n4", "one", "g0", "g2", "n2", "late"}
    for ticket in want:
        assert_same(got[ticket], want[ticket], atol=1e-5)
    counts = [c for c, _ in seen[True]]
    # n4, n2 and the group at once; a pool adapter has no fingerprint, so no prefix cache: its
    # group's requests prefill apart and stay in their own columns.
    assert max(counts) == (2 if adapter else 3) and counts[-1] == 0 and not any(c for c, _ in seen[False])


@pytest.mark.parametrize("name", MODELS)
def test_a_long_prompt_with_many_samples_is_held_once(eng, name):
    """num_samples=8 of a 200-token prompt: the batch holds the prompt once beside eight rows of
    generated columns, where copying it holds eight copies."""
    prompt = np.random.default_rng(0).integers(100, 500, size=200)
    op = SampleOp(name, None, prompt, SamplingParams(max_tokens=3, temperature=1.0, seed=1, stop_at_eos=False), num_samples=8)
    peak = {}
    for share in (True, False):
        sampler = Sampler(eng.runtime(name), SamplerConfig(share_prompts=share))
        peak[share] = []
        drive(sampler, {0: [("r", op)]}, lambda t, s: peak[share].append(s.kv_cache_bytes()))
    token_bytes = sampler.kv_token_bytes
    assert max(peak[False]) >= 8 * 200 * token_bytes  # each row its own copy
    assert max(peak[True]) < 200 * token_bytes + 8 * 100 * token_bytes  # one copy + rows' own columns


def test_the_kv_budget_counts_a_prompt_held_once_once(eng):
    """A request of 8 samples of a 200-token prompt needs 8 x 204 positions as copies, 200 + 8 x 4
    held once: under a budget of 400 positions it is refused without sharing and runs with it (and
    samples what the copies sample); two such requests run side by side under 500, in turn under 400."""
    name = MODELS[0]
    rt = eng.runtime(name)
    per_token = Sampler(rt).kv_token_bytes

    def op(seed):
        prompt = np.random.default_rng(seed).integers(100, 500, size=200)
        return SampleOp(name, None, prompt, SamplingParams(max_tokens=4, temperature=1.0, seed=seed, stop_at_eos=False),
                        num_samples=8)

    with pytest.raises(UserError, match="8 samples x 204 prompt"):
        Sampler(rt, SamplerConfig(share_prompts=False, kv_cache_bytes=400 * per_token)).admit("a", op(1))
    want = drive(Sampler(rt, SamplerConfig(share_prompts=False)), {0: [("a", op(1)), ("b", op(2))]})
    for share, positions, together in ((True, 400, False), (True, 500, True), (False, 8 * 204, False)):
        rows, held = [], []

        def seen(t, s):
            rows.append(len(s.rows))
            held.append(s.kv_cache_bytes())

        sampler = Sampler(rt, SamplerConfig(share_prompts=share, kv_cache_bytes=positions * per_token))
        got = drive(sampler, {0: [("a", op(1)), ("b", op(2))]}, seen)
        assert max(rows) == (16 if together else 8)
        # What the cache allocates stays inside what the budget counted: a rebuild's spare columns
        # stop at the rows' max_tokens (not 64 or W / 2 more columns per row).
        assert 0 < max(held) <= positions * per_token
        for ticket in "ab":
            assert_same(got[ticket], want[ticket], atol=1e-5)
