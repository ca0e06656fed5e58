"""The continuous decode batch: requests join and leave at any step, fused rows compute what each
request computes alone, the KV cache keeps every row's own positions, long prompts are prefilled
in chunks, sampler adapters are evicted LRU but never from under a running request, and
`Engine.step(StepBatch)` returns results steps after admission. Shapes: B rows, T tokens, V vocab.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch
from transformers import DynamicCache

from tinkerd.engine import checkpoints
from tinkerd.engine.engine import Engine
from tinkerd.engine.sampler import sample as sample_mod
from tinkerd.engine.sampler.kv import BatchCache, kv_bytes_per_token
from tinkerd.engine.sampler.sample import Sampler, SamplerConfig, run_sample
from tinkerd.errors import ServerError, UserError
from tinkerd.types import CreateModelOp, LoraSpec, SampleOp, SamplingParams, StepBatch, StepOutput

TINY = "tinkerd/tiny-qwen3"
PROMPT = [9707, 11, 1879, 0, 220, 3555, 13, 1416, 2585, 525, 498, 30, 11454]  # 13 ids


@pytest.fixture(scope="module")
def eng(models_dir) -> Engine:
    """This file's own engine: the eviction tests empty its pool of idle sampler adapters."""
    e = Engine(models_dir)
    e.load_base_model(TINY)
    return e


@pytest.fixture(scope="module")
def adapters(eng):
    """Pool keys of a fresh adapter (B = 0) and two with random B. Trainable, so never evicted."""
    pool = eng.runtime(TINY).pool
    gen = torch.Generator().manual_seed(7)
    keys = ["b-fresh", "b-rand1", "b-rand2"]
    for i, key in enumerate(keys):
        a = pool.create(key, LoraSpec(rank=4, alpha=8, seed=20 + i), trainable=True)
        if i:
            with torch.no_grad():
                for _, b in a.weights.values():
                    b.copy_(torch.randn(b.shape, generator=gen) * 0.5)
    return keys


@pytest.fixture
def pool_keys_as_paths(monkeypatch):
    """Requests name pool keys as adapter_path (no checkpoint files); the real loader is tested below."""
    monkeypatch.setattr(sample_mod, "acquire_adapter", lambda rt, path, max_idle: rt.pool.acquire(path) if path else None)


def op(prompt, max_tokens, adapter=None, **kw) -> SampleOp:
    extra = {k: kw.pop(k) for k in list(kw) if k in ("num_samples", "prompt_logprobs", "topk_prompt_logprobs",
                                                     "prompt_logprobs_last_n", "topk_sample_logprobs")}
    params = SamplingParams(max_tokens=max_tokens, stop_at_eos=kw.pop("stop_at_eos", False), **kw)
    return SampleOp(TINY, adapter, np.array(prompt, dtype=np.int64), params, **extra)


def drive(sampler: Sampler, schedule: dict[int, list[tuple[str, SampleOp]]], on_step=None) -> dict[str, object]:
    """Admit schedule[s] before step s; step until nothing is in flight. Returns results by ticket."""
    results: dict[str, object] = {}
    step = 0
    while step <= max(schedule) or sampler.active_rows:
        for ticket, o in schedule.get(step, []):
            sampler.admit(ticket, o)
        for ticket, result in sampler.step():
            assert ticket not in results
            results[ticket] = result
        if on_step is not None:
            on_step(step, sampler)
        step += 1
    return results


def assert_same(fused, alone, atol=1e-4):
    assert len(fused.sequences) == len(alone.sequences)
    for f, a in zip(fused.sequences, alone.sequences):
        assert f.tokens == a.tokens and f.stop_reason == a.stop_reason
        np.testing.assert_allclose(f.logprobs, a.logprobs, atol=atol)
        if a.topk_logprobs is not None:
            assert (f.topk_logprobs[0] == a.topk_logprobs[0]).all()
            np.testing.assert_allclose(f.topk_logprobs[1], a.topk_logprobs[1], atol=atol)
    for name in ("prompt_logprobs",):
        if getattr(alone, name) is not None:
            np.testing.assert_allclose(getattr(fused, name), getattr(alone, name), atol=atol)
    if alone.topk_prompt_logprobs is not None:
        assert (fused.topk_prompt_logprobs[0] == alone.topk_prompt_logprobs[0]).all()


# --- fusion ----------------------------------------------------------------------------------------


def test_requests_joining_mid_flight_compute_what_they_compute_alone(eng, adapters, pool_keys_as_paths):
    fresh, rand1, rand2 = adapters
    requests = {
        "base-greedy": op(PROMPT[:8], 10, temperature=0.0),
        "rand1-seeded": op(PROMPT[:3], 7, rand1, temperature=1.0, seed=5, num_samples=2),
        "fresh-topk-topp": op(PROMPT, 5, fresh, top_k=20, top_p=0.9, seed=4, prompt_logprobs=True, topk_prompt_logprobs=3),
        "rand2-stops": op(PROMPT[:5], 9, rand2, temperature=0.0, topk_sample_logprobs=2),
    }
    alone = {t: run_sample(eng, o) for t, o in requests.items()}
    # A stop token from the middle of rand2's free run, so that request leaves the batch early.
    stop = alone["rand2-stops"].sequences[0].tokens[3]
    requests["rand2-stops"] = replace(requests["rand2-stops"], params=replace(requests["rand2-stops"].params,
                                                                              stop_token_seqs=((stop,),)))
    alone["rand2-stops"] = run_sample(eng, requests["rand2-stops"])
    assert alone["rand2-stops"].sequences[0].stop_reason == "stop"

    rt = eng.runtime(TINY)
    seen: list[tuple[int, int]] = []  # (rows, distinct adapter groups) of every one-token decoder pass
    # On the embedding, which every pass starts with: [rows, 1] through the HF body, [rows] through
    # the fused decode step (decode.py); prefills here are longer than one token.
    hook = rt.model.get_decoder().embed_tokens.register_forward_pre_hook(
        lambda m, a: seen.append((a[0].shape[0], len(rt.ctx.groups))) if a[0].dim() == 1 or a[0].shape[1] == 1
        else None
    )
    try:
        schedule = {0: [("base-greedy", requests["base-greedy"]), ("rand1-seeded", requests["rand1-seeded"])],
                    2: [("fresh-topk-topp", requests["fresh-topk-topp"])], 4: [("rand2-stops", requests["rand2-stops"])]}
        fused = drive(Sampler(rt), schedule)
    finally:
        hook.remove()
    assert max(groups for _, groups in seen) == 4  # base + three adapters in one forward
    assert max(rows for rows, _ in seen) == 5 and seen[-1][0] < 5  # rows joined, then left
    for ticket in requests:
        assert_same(fused[ticket], alone[ticket])


def test_fused_greedy_equals_naive_full_recompute(eng, adapters, pool_keys_as_paths):
    """The padded, per-row-positioned decode batch against full forwards of each whole sequence."""
    rt = eng.runtime(TINY)
    prompts = {"short": PROMPT[:2], "long": PROMPT, "mid": PROMPT[3:9]}
    keys = {"short": adapters[1], "long": None, "mid": adapters[2]}
    schedule = {0: [("long", op(prompts["long"], 6, keys["long"], temperature=0.0))],
                1: [("short", op(prompts["short"], 6, keys["short"], temperature=0.0)),
                    ("mid", op(prompts["mid"], 6, keys["mid"], temperature=0.0))]}
    fused = drive(Sampler(rt), schedule)
    for name, prompt in prompts.items():
        slot = rt.pool.get(keys[name]).slot if keys[name] else -1
        seq = list(prompt)
        rt.ctx.set_single(slot)
        try:
            with torch.inference_mode():
                for _ in range(6):
                    logits = rt.model(input_ids=torch.tensor([seq])).logits[0]  # [T, V]
                    seq.append(int(logits[-1].argmax()))
                lp = torch.log_softmax(rt.model(input_ids=torch.tensor([seq])).logits[0].float(), -1)
        finally:
            rt.ctx.clear()
        got = fused[name].sequences[0]
        assert got.tokens == seq[len(prompt):]
        want = lp[torch.arange(len(prompt) - 1, len(seq) - 1), torch.tensor(got.tokens)]
        np.testing.assert_allclose(got.logprobs, want.numpy(), atol=1e-4)


def test_long_prompt_is_prefilled_in_chunks_while_others_decode(eng):
    rt = eng.runtime(TINY)
    long_prompt = (PROMPT * 3)[:32]
    short = op(PROMPT[:3], 12, temperature=0.0)
    long = op(long_prompt, 3, temperature=0.0, prompt_logprobs=True, topk_prompt_logprobs=2)
    sampler = Sampler(rt, SamplerConfig(prefill_tokens_per_step=4))
    progress: list[tuple[int, int]] = []  # (short's tokens so far, long's prompt tokens prefilled)

    def on_step(step, s):
        short_rows = [r for r in s.rows if r.request.ticket == "short"]
        long_req = [r for r in s.joining if r.ticket == "long"]
        progress.append((len(short_rows[0].tokens) if short_rows else -1, long_req[0].prefill.done if long_req else -1))

    admitted = {}
    real_admit = sampler.admit

    def admit(ticket, o):
        real_admit(ticket, o)
        admitted[ticket] = sampler.joining[-1]

    sampler.admit = admit
    results = drive(sampler, {0: [("short", short)], 1: [("long", long)]}, on_step)
    # Steps 1-7: the long prompt advances 4 tokens per step and the short row still gets a token
    # every step; at step 8 the last chunk joins the batch.
    assert progress[1:8] == [(1 + i, 4 * i) for i in range(1, 8)]
    assert admitted["long"].prefill.chunk_calls == [4] * 8
    assert_same(results["long"], run_sample(eng, long), atol=1e-5)
    assert_same(results["short"], run_sample(eng, short), atol=1e-5)


def test_a_prompt_that_fits_one_step_is_never_split(eng):
    """Budget 8, prompts of 5 and 5 tokens: the second goes whole into the first step (10 tokens)
    instead of being cut 3 + 2, and both rows start decoding together; a 12-token prompt, longer
    than a step's budget, is still cut to what is left of it."""
    rt = eng.runtime(TINY)
    sampler = Sampler(rt, SamplerConfig(prefill_tokens_per_step=8))
    a, b, long = op(PROMPT[:5], 4, temperature=0.0), op(PROMPT[5:10], 4, temperature=0.0), op(PROMPT[:12], 2, temperature=0.0)
    for ticket, o in (("a", a), ("b", b), ("long", long)):
        sampler.admit(ticket, o)
    requests = {r.ticket: r for r in sampler.joining}
    sampler.step()
    assert requests["a"].prefill.chunk_calls == [5] and requests["b"].prefill.chunk_calls == [5]
    assert sorted(r.request.ticket for r in sampler.rows) == ["a", "b"]
    assert requests["long"].prefill.done == 0  # the budget was spent: it starts next step
    results = drive(sampler, {0: []})
    assert requests["long"].prefill.chunk_calls == [8, 4]
    for ticket, o in (("a", a), ("b", b), ("long", long)):
        assert_same(results[ticket], run_sample(eng, o), atol=1e-5)


def test_a_request_whose_kv_cache_alone_is_over_the_budget_is_refused_at_admission(eng):
    rt = eng.runtime(TINY)
    per_row = (len(PROMPT) + 20) * kv_bytes_per_token(rt.model.config, torch.float32)
    # Copied prompts (share_prompts=False): every sample's row counts its prompt; a prompt held
    # once is counted in test_sampler_shared.py.
    sampler = Sampler(rt, SamplerConfig(kv_cache_bytes=3 * per_row, share_prompts=False))
    with pytest.raises(UserError, match=r"KV cache would take .*\(4 samples x 33 .*lower num_samples or max_tokens"):
        sampler.admit("big", op(PROMPT, 20, num_samples=4))
    assert sampler.active_rows == 0 and not sampler.joining
    results = drive(sampler, {0: [("fits", op(PROMPT, 20, num_samples=3, temperature=0.0))]})
    assert [len(s.tokens) for s in results["fits"].sequences] == [20] * 3


def test_requests_wait_in_order_for_kv_room_and_compute_what_they_compute_alone(eng):
    rt = eng.runtime(TINY)
    a = op(PROMPT, 8, num_samples=2, temperature=0.0)  # 2 rows up to 21 positions wide
    b = op(PROMPT[:4], 6, temperature=1.0, seed=3)  # up to 10
    c = op(PROMPT[:2], 3, temperature=0.0)  # up to 5: it would fit beside a, but was admitted after b
    per_token = kv_bytes_per_token(rt.model.config, torch.float32)
    # a, not a third row (a's prompt copied into both its rows: share_prompts=False)
    sampler = Sampler(rt, SamplerConfig(kv_cache_bytes=2 * 21 * per_token + per_token, share_prompts=False))
    steps_with_rows: dict[str, list[int]] = {}

    def on_step(step, s):
        for row in s.rows:
            steps_with_rows.setdefault(row.request.ticket, []).append(step)

    results = drive(sampler, {0: [("a", a), ("b", b), ("c", c)]}, on_step)
    assert steps_with_rows["a"][0] == 0
    # b waited for a's rows to leave, and c, behind it, did not pass it; then both fit together.
    assert steps_with_rows["b"][0] == steps_with_rows["c"][0] > steps_with_rows["a"][-1]
    for ticket, o in {"a": a, "b": b, "c": c}.items():
        assert_same(results[ticket], run_sample(eng, o), atol=1e-5)


def test_kv_cache_rows_are_right_aligned_and_masked_per_row():
    kv, d = 2, 3  # heads, head dim

    def prefilled(p: int, value: float) -> DynamicCache:
        c = DynamicCache()
        for layer in range(2):
            k = torch.full((1, kv, p, d), value + layer) + torch.arange(p, dtype=torch.float32)[None, None, :, None]
            c.update(k, -k, layer)
        return c

    cache = BatchCache(2)
    cache.join([(prefilled(3, 10.0), 2), (prefilled(5, 20.0), 1)], [8, 8])  # rows 0, 1: P = 3; row 2: P = 5
    assert cache.width == 5 and cache.lengths.tolist() == [3, 3, 5]
    keys = cache.layers[1].keys[:, :, :5]  # [B, KV, W, D]
    assert (keys[:2, :, :2] == 0).all()  # two columns of padding before the short rows
    assert keys[:2, 0, 2:, 0].tolist() == [[11.0, 12.0, 13.0]] * 2 and keys[2, 0, :, 0].tolist() == [21, 22, 23, 24, 25]
    assert (cache.layers[1].values[:, :, :5] == -keys).all()

    positions, mask = cache.step_inputs()
    assert positions.tolist() == [[3], [3], [5]]  # the row's own next position, not the padded column
    assert mask.shape == (3, 1, 1, 6)
    assert mask[:, 0, 0].tolist() == [[False, False, True, True, True, True]] * 2 + [[True] * 6]
    for layer in cache.layers:  # what a body forward does: one new column per row, then advance
        layer.update(torch.full((3, kv, 1, d), 99.0), torch.full((3, kv, 1, d), -99.0))
    cache.advance()
    assert cache.width == 6 and cache.lengths.tolist() == [4, 4, 6]

    cache.keep([0, 1])  # the long row left: its two extra leading columns go with it
    assert cache.width == 4 and cache.lengths.tolist() == [4, 4]
    assert cache.layers[1].keys[:, 0, :4, 0].tolist() == [[11.0, 12.0, 13.0, 99.0]] * 2
    cache.keep([])
    assert cache.rows == 0 and cache.width == 0
    cache.join([(prefilled(2, 30.0), 1)], [8])  # an emptied batch takes new rows
    assert cache.layers[0].keys[0, 0, :2, 0].tolist() == [30.0, 31.0]


# --- prompt logprobs over the last N, top-k of sampled tokens --------------------------------------


def test_prompt_logprobs_last_n_scores_only_the_suffix(eng):
    full = run_sample(eng, op(PROMPT, 1, prompt_logprobs=True, topk_prompt_logprobs=2))
    part = run_sample(eng, op(PROMPT, 1, prompt_logprobs=True, topk_prompt_logprobs=2, prompt_logprobs_last_n=3))
    assert np.isnan(part.prompt_logprobs[:-3]).all()
    np.testing.assert_allclose(part.prompt_logprobs[-3:], full.prompt_logprobs[-3:], atol=1e-6)
    ids, lps = part.topk_prompt_logprobs
    assert (lps[:-3] == -99999.0).all() and (ids[:-3] == 0).all()  # empty rows: None in the SDK
    assert (ids[-3:] == full.topk_prompt_logprobs[0][-3:]).all()
    # N at or past the prompt length scores every position that can be scored.
    every = run_sample(eng, op(PROMPT, 1, prompt_logprobs=True, prompt_logprobs_last_n=len(PROMPT)))
    np.testing.assert_allclose(every.prompt_logprobs, full.prompt_logprobs, atol=1e-6)


@pytest.mark.parametrize("params", [dict(temperature=0.0), dict(temperature=1.5, seed=3)])
def test_topk_sample_logprobs_are_the_full_distributions_best(eng, params):
    res = run_sample(eng, op(PROMPT[:6], 5, topk_sample_logprobs=3, **params))
    (seq,) = res.sequences
    ids, lps = seq.topk_logprobs
    assert ids.shape == lps.shape == (5, 3)
    assert (np.diff(lps, axis=1) <= 0).all()
    rt = eng.runtime(TINY)
    with torch.inference_mode():
        full = torch.log_softmax(rt.model(input_ids=torch.tensor([PROMPT[:6] + seq.tokens])).logits[0].float(), -1)
    for i in range(5):
        np.testing.assert_allclose(lps[i], full[5 + i, torch.from_numpy(ids[i])].numpy(), atol=1e-4)
        assert lps[i, 0] == pytest.approx(float(full[5 + i].max()), abs=1e-4)
        assert seq.logprobs[i] <= lps[i, 0] + 1e-6
    if params["temperature"] == 0.0:
        assert ids[:, 0].tolist() == seq.tokens


# --- adapters from paths: LRU eviction, never under a running request -----------------------------


def _save(eng, key: str, path) -> str:
    checkpoints.save_adapter(eng.runtime(TINY).pool.get(key), TINY, str(path), with_optimizer=False)
    return str(path)


def _slots_in_layers(rt) -> set[int]:
    return {slot for layer in rt.layers.values() for slot in layer.adapters}


def test_idle_sampler_adapters_are_evicted_lru_but_not_while_in_use(eng, adapters, tmp_path):
    rt = eng.runtime(TINY)
    p1, p2, p3 = (_save(eng, k, tmp_path / f"s{i}") for i, k in enumerate([adapters[1], adapters[2], adapters[0]]))
    want1 = run_sample(eng, op(PROMPT[:4], 6, p1, temperature=0.0))
    want2 = run_sample(eng, op(PROMPT[:4], 6, p2, temperature=0.0))
    rt.pool.evict_idle(keep=0)  # start from an empty cache, so y's admission below loads p2
    sampler = Sampler(rt, SamplerConfig(max_sampler_adapters=1))
    # p1's request is decoding when p2 is loaded: over the bound, p1 stays (it is in use).
    got = drive(sampler, {0: [("x", op(PROMPT[:4], 6, p1, temperature=0.0))],
                          2: [("y", op(PROMPT[:4], 6, p2, temperature=0.0))]})
    assert_same(got["x"], want1)
    assert_same(got["y"], want2)
    slot1, slot2 = rt.pool.get(p1).slot, rt.pool.get(p2).slot
    assert rt.pool.get(p1).users == rt.pool.get(p2).users == 0
    # Loading a third while both are idle evicts them, least recently used first; their tensors leave the layers.
    drive(sampler, {0: [("z", op(PROMPT[:4], 2, p3))]})
    assert p1 not in rt.pool and p2 not in rt.pool and p3 in rt.pool
    assert slot1 not in _slots_in_layers(rt) and slot2 not in _slots_in_layers(rt)
    assert all(a.key in adapters for a in rt.pool.adapters.values() if a.key != p3)  # training adapters stay


def test_resaved_checkpoint_serves_new_requests_while_running_ones_keep_the_old_weights(eng, adapters, tmp_path):
    rt = eng.runtime(TINY)
    path = _save(eng, adapters[1], tmp_path / "s")
    old = run_sample(eng, op(PROMPT[:4], 8, path, temperature=0.0))
    base = run_sample(eng, op(PROMPT[:4], 8, temperature=0.0))
    assert old.sequences[0].tokens != base.sequences[0].tokens
    sampler = Sampler(rt)
    sampler.admit("before", op(PROMPT[:4], 8, path, temperature=0.0))
    got = {t: r for t, r in sampler.step() + sampler.step()}
    _save(eng, adapters[0], path)  # the fresh adapter (= the base model), renamed into place
    got.update(drive(sampler, {0: [("after", op(PROMPT[:4], 8, path, temperature=0.0))]}))
    assert_same(got["before"], old)
    assert_same(got["after"], base)
    retired = [k for k in rt.pool.adapters if k.startswith(path + "\0")]
    assert len(retired) == 1 and rt.pool.get(retired[0]).users == 0
    evicted = rt.pool.evict_idle(keep=1)
    assert evicted[0] == retired[0] and path in rt.pool  # the stale one goes first, the live one stays


# --- the engine step contract ----------------------------------------------------------------------


def test_engine_step_returns_results_in_the_step_they_finish(eng):
    bad = op([5, 10**7], 3)  # a token id outside the vocabulary
    good = op(PROMPT[:5], 3, temperature=0.0)
    out = eng.step(StepBatch(run=[("create", CreateModelOp("step-m", TINY, LoraSpec(rank=2, alpha=4)))],
                             admit=[("bad", bad), ("good", good)], decode=True))
    assert isinstance(out, StepOutput)
    done = dict(out.done)
    assert done["create"] == {"model_id": "step-m"}
    assert isinstance(done["bad"], UserError) and "vocabulary" in done["bad"].message
    assert "good" not in done and out.active_rows == 1  # prefilled and one token: 2 more to go
    later = []
    while out.active_rows:
        out = eng.step(StepBatch(decode=True))
        later += out.done
    assert [t for t, _ in later] == ["good"]
    assert_same(later[0][1], run_sample(eng, good))
    # A step with nothing to do is harmless; the list form still runs ops to completion.
    assert eng.step(StepBatch(decode=True)) == StepOutput([], 0)
    (res,) = eng.run_ops([good])
    assert_same(res, later[0][1])


def test_a_failing_decode_step_fails_its_batch_and_the_sampler_goes_on(eng, monkeypatch):
    rt = eng.runtime(TINY)
    sampler = Sampler(rt, SamplerConfig(prefill_tokens_per_step=4))
    real = sample_mod.choose_tokens
    calls = {"n": 0}

    def flaky(logits, rules):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("boom")
        return real(logits, rules)

    monkeypatch.setattr(sample_mod, "choose_tokens", flaky)
    long = op((PROMPT * 2)[:20], 3, temperature=0.0)
    got = drive(sampler, {0: [("decoding", op(PROMPT[:3], 6, temperature=0.0))], 1: [("joining", long)]})
    assert isinstance(got["decoding"], ServerError) and "boom" in got["decoding"].message
    assert_same(got["joining"], run_sample(eng, long))  # it was prefilling, outside the failed batch
    assert rt.ctx.groups == [] and rt.ctx.sampling is False
