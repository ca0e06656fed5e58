"""The sampler against references: a naive full-recompute generate, full-forward logprobs, and
hand-built distributions for the token-choice rules. Shapes: B rows, T tokens, V vocab."""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import pytest
import torch

from tinkerd.engine.engine import Engine
from tinkerd.engine.sampler import adapters as adapters_mod
from tinkerd.engine.sampler import sample as sample_mod
from tinkerd.engine.sampler.rules import MAX_TOPK_PAIRS, RowRules, _inverse_cdf, choose_tokens, validate
from tinkerd.engine.sampler.sample import run_sample
from tinkerd.errors import NotFoundError, ServerError, UserError
from tinkerd.types import LoraSpec, SampleOp, SamplingParams

TINY = "tinkerd/tiny-qwen3"
PROMPT = np.array([9707, 11, 1879, 0, 220, 3555, 13, 1416], dtype=np.int64)  # "Hello, world!..." ids


@pytest.fixture(scope="module")
def sampler_engine(tmp_path_factory) -> Engine:
    engine = Engine(tmp_path_factory.mktemp("sampler-models"))
    engine.load_base_model(TINY)
    return engine


@pytest.fixture(scope="module")
def sampler_adapters(sampler_engine):
    """Pool keys of a fresh adapter (B = 0) and of one with random non-zero B, rank 4."""
    pool = sampler_engine.runtime(TINY).pool
    pool.create("sampler-fresh", LoraSpec(rank=4, alpha=8, seed=1), trainable=False)
    rand = pool.create("sampler-random", LoraSpec(rank=4, alpha=8, seed=2), trainable=False)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for _, b in rand.weights.values():
            b.copy_(torch.randn(b.shape, generator=gen) * 0.5)
    return "sampler-fresh", "sampler-random"


def op(params: SamplingParams, prompt=PROMPT, **kw) -> SampleOp:
    return SampleOp(base_model=TINY, adapter_path=None, prompt=prompt, params=params, **kw)


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, **kw)


@dataclass
class Oracle:
    """Full forwards of the whole sequence, no KV cache: the reference every test pins against."""

    engine: Engine
    slot: int = -1

    def logprobs(self, tokens: list[int]) -> torch.Tensor:
        """[T, V] log-softmax of the logits at every position of `tokens`."""
        rt = self.engine.runtime(TINY)
        rt.ctx.set_single(self.slot)
        try:
            with torch.inference_mode():
                logits = rt.model(input_ids=torch.tensor([tokens])).logits[0]
        finally:
            rt.ctx.clear()
        return torch.log_softmax(logits.float(), dim=-1)

    def generate(self, prompt: list[int], n: int) -> list[int]:
        seq = list(prompt)
        for _ in range(n):
            seq.append(int(self.logprobs(seq)[-1].argmax()))
        return seq[len(prompt):]

    def token_logprobs(self, prompt: list[int], generated: list[int]) -> np.ndarray:
        lp = self.logprobs(list(prompt) + list(generated))
        pos = torch.arange(len(prompt) - 1, len(prompt) - 1 + len(generated))
        return lp[pos, torch.tensor(generated)].numpy()


def slot_of(engine, key):
    return engine.runtime(TINY).pool.get(key).slot if key else -1


def run_with_slot(engine, slot_key, o: SampleOp):
    """Sample through an adapter that lives in the pool under slot_key (no checkpoint dir needed)."""
    if slot_key is None:
        return run_sample(engine, o)
    real = sample_mod.acquire_adapter
    sample_mod.acquire_adapter = lambda rt, path, max_idle: rt.pool.acquire(slot_key)
    try:
        return run_sample(engine, replace(o, adapter_path="unused"))
    finally:
        sample_mod.acquire_adapter = real


# --- greedy equals the naive generate ------------------------------------------------------------


@pytest.mark.parametrize("which", ["base", "random"])
def test_greedy_equals_naive_generate(sampler_engine, sampler_adapters, which):
    key = None if which == "base" else sampler_adapters[1]
    oracle = Oracle(sampler_engine, slot_of(sampler_engine, key))
    want = oracle.generate(PROMPT.tolist(), 8)
    res = run_with_slot(sampler_engine, key, op(greedy(8, stop_at_eos=False)))
    (seq,) = res.sequences
    assert seq.tokens == want
    assert seq.stop_reason == "length"
    np.testing.assert_allclose(seq.logprobs, oracle.token_logprobs(PROMPT.tolist(), want), atol=1e-4)


def test_random_adapter_changes_the_output(sampler_engine, sampler_adapters):
    """Guards the test above: an adapter that did nothing would pass it trivially."""
    base = run_sample(sampler_engine, op(greedy(8))).sequences[0].tokens
    adapted = run_with_slot(sampler_engine, sampler_adapters[1], op(greedy(8))).sequences[0].tokens
    assert base != adapted


def test_fresh_adapter_samples_like_the_base(sampler_engine, sampler_adapters):
    params = SamplingParams(max_tokens=6, temperature=1.0, seed=11)
    base = run_sample(sampler_engine, op(params, num_samples=2))
    fresh = run_with_slot(sampler_engine, sampler_adapters[0], op(params, num_samples=2))
    for a, b in zip(base.sequences, fresh.sequences):
        assert a.tokens == b.tokens
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-6)


# --- logprobs of sampled tokens --------------------------------------------------------------------


@pytest.mark.parametrize(
    "which, params",
    [
        ("base", SamplingParams(max_tokens=6, temperature=0.7, top_k=20, seed=5)),
        ("random", SamplingParams(max_tokens=6, temperature=1.3, top_p=0.8, seed=6)),
    ],
)
def test_sampled_logprobs_are_raw_full_forward_logprobs(sampler_engine, sampler_adapters, which, params):
    """Temperature / top-k / top-p pick the token; the logprob is the untempered model's."""
    key = None if which == "base" else sampler_adapters[1]
    oracle = Oracle(sampler_engine, slot_of(sampler_engine, key))
    res = run_with_slot(sampler_engine, key, op(params, num_samples=3))
    for seq in res.sequences:
        assert len(seq.logprobs) == len(seq.tokens) == 6
        np.testing.assert_allclose(seq.logprobs, oracle.token_logprobs(PROMPT.tolist(), seq.tokens), atol=1e-4)


# --- seeds and rows --------------------------------------------------------------------------------


def test_same_seed_same_tokens_different_seed_different(sampler_engine):
    def tokens(seed):
        res = run_sample(sampler_engine, op(SamplingParams(max_tokens=4, seed=seed), num_samples=2))
        return [s.tokens for s in res.sequences]

    first = tokens(123)
    assert tokens(123) == first
    assert tokens(124) != first
    # No seed: fresh randomness each time.
    assert tokens(None) != tokens(None)


def test_rows_are_independent_and_share_one_prefill(sampler_engine):
    rt = sampler_engine.runtime(TINY)
    calls: list[tuple[int, int]] = []  # (rows, tokens per row) of every pass through the decoder
    # Hooked on the embedding, which every pass starts with: the HF body gets [rows, tokens], the
    # fused decode step (decode.py) [rows].
    hook = rt.model.get_decoder().embed_tokens.register_forward_pre_hook(
        lambda mod, args: calls.append(tuple(args[0].shape) if args[0].dim() == 2 else (args[0].shape[0], 1))
    )
    try:
        res = run_sample(sampler_engine, op(SamplingParams(max_tokens=5, seed=9, stop_at_eos=False), num_samples=4))
    finally:
        hook.remove()
    assert calls[0] == (1, len(PROMPT))  # the prompt, once, for one row
    assert calls[1:] == [(4, 1)] * 4  # then one token per row per step (the 5th token needs no step)
    rows = [s.tokens for s in res.sequences]
    assert len({tuple(r) for r in rows}) == 4  # independent draws, not copies
    # Row r's stream depends on (seed, r) only, not on how many rows share the batch.
    single = run_sample(sampler_engine, op(SamplingParams(max_tokens=5, seed=9, stop_at_eos=False)))
    assert single.sequences[0].tokens == rows[0]


# --- stops -----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def greedy_tokens(sampler_engine) -> list[int]:
    return run_sample(sampler_engine, op(greedy(10, stop_at_eos=False))).sequences[0].tokens


def test_stop_token_is_included_with_reason_stop(sampler_engine, greedy_tokens):
    stop_tok = greedy_tokens[3]
    first = greedy_tokens.index(stop_tok)
    (seq,) = run_sample(sampler_engine, op(greedy(10, stop_token_seqs=((stop_tok,),)))).sequences
    assert seq.tokens == greedy_tokens[: first + 1]
    assert seq.tokens[-1] == stop_tok and seq.stop_reason == "stop"
    assert len(seq.logprobs) == len(seq.tokens)


def test_multi_token_stop_sequence(sampler_engine, greedy_tokens):
    stop = tuple(greedy_tokens[4:6])
    n = next(i + 2 for i in range(len(greedy_tokens) - 1) if tuple(greedy_tokens[i : i + 2]) == stop)
    (seq,) = run_sample(sampler_engine, op(greedy(10, stop_token_seqs=((999_999, 1), stop)))).sequences
    assert seq.tokens == greedy_tokens[:n] and seq.stop_reason == "stop"


def test_stop_string_ends_on_the_completing_token(sampler_engine, greedy_tokens):
    tok = sampler_engine.runtime(TINY).tokenizer
    decode = lambda ids: tok.decode(ids, skip_special_tokens=False)  # noqa: E731
    # A string spanning tokens 4 and 5 that ends exactly where token 5 does: the last character of
    # one and all of the next, so only token 5 completes it.
    stop = decode(greedy_tokens[4:5])[-1:] + decode(greedy_tokens[5:6])
    n = next(i for i in range(1, len(greedy_tokens) + 1) if stop in decode(greedy_tokens[:i]))
    assert n < len(greedy_tokens)
    (seq,) = run_sample(sampler_engine, op(greedy(10, stop_strings=("never appears", stop)))).sequences
    assert seq.tokens == greedy_tokens[:n] and seq.stop_reason == "stop"


def test_eos_stops_unless_stop_at_eos_is_false(sampler_engine, greedy_tokens, monkeypatch):
    rt = sampler_engine.runtime(TINY)
    eos = greedy_tokens[2]
    first = greedy_tokens.index(eos)
    monkeypatch.setattr(rt.loaded, "eos_token_ids", [eos])
    (seq,) = run_sample(sampler_engine, op(greedy(10))).sequences
    assert seq.tokens == greedy_tokens[: first + 1] and seq.stop_reason == "stop"
    (seq,) = run_sample(sampler_engine, op(greedy(10, stop_at_eos=False))).sequences
    assert seq.tokens == greedy_tokens and seq.stop_reason == "length"


def test_rows_finish_independently(sampler_engine):
    """A row that stops leaves the batch; the others go on to max_tokens with unchanged tokens."""
    params = SamplingParams(max_tokens=6, seed=21, stop_at_eos=False)
    free = run_sample(sampler_engine, op(params, num_samples=3)).sequences
    stop_tok = free[1].tokens[2]
    stopped = run_sample(sampler_engine, op(replace(params, stop_token_seqs=((stop_tok,),)), num_samples=3)).sequences
    for a, b in zip(free, stopped):
        if stop_tok in a.tokens:
            n = a.tokens.index(stop_tok) + 1
            assert b.tokens == a.tokens[:n] and b.stop_reason == "stop"
        else:
            assert b.tokens == a.tokens and b.stop_reason == "length"
    assert stopped[1].stop_reason == "stop"


# --- prompt logprobs -------------------------------------------------------------------------------


def test_prompt_logprobs_equal_full_forward(sampler_engine, sampler_adapters):
    oracle = Oracle(sampler_engine, slot_of(sampler_engine, sampler_adapters[1]))
    res = run_with_slot(sampler_engine, sampler_adapters[1], op(greedy(1), prompt_logprobs=True))
    lp = res.prompt_logprobs
    assert lp.shape == (len(PROMPT),) and lp.dtype == np.float32 and np.isnan(lp[0])
    want = oracle.token_logprobs(PROMPT[:1].tolist(), PROMPT[1:].tolist())
    np.testing.assert_allclose(lp[1:], want, atol=1e-4)
    assert res.topk_prompt_logprobs is None


def test_topk_prompt_logprobs(sampler_engine, greedy_tokens):
    # A prompt that continues with the model's own greedy tokens, so top-1 is the actual token there.
    prompt = np.array(PROMPT.tolist() + greedy_tokens[:5], dtype=np.int64)
    k = 4
    res = run_sample(sampler_engine, op(greedy(1), prompt=prompt, prompt_logprobs=True, topk_prompt_logprobs=k))
    ids, lps = res.topk_prompt_logprobs
    assert ids.shape == lps.shape == (len(prompt), k)
    assert (ids[0] == 0).all() and (lps[0] == -99999.0).all()  # row 0: empty, the SDK's None
    assert (np.diff(lps[1:], axis=1) <= 0).all()  # best first
    full = Oracle(sampler_engine).logprobs(prompt.tolist())  # [T, V]
    for i in range(1, len(prompt)):
        np.testing.assert_allclose(lps[i], full[i - 1, torch.from_numpy(ids[i])].numpy(), atol=1e-4)
        assert lps[i, 0] == pytest.approx(float(full[i - 1].max()), abs=1e-4)
        assert lps[i, 0] >= res.prompt_logprobs[i] - 1e-5
    top1_is_actual = ids[1:, 0] == prompt[1:]
    assert top1_is_actual[len(PROMPT) :].all()
    np.testing.assert_allclose(lps[1:, 0][top1_is_actual], res.prompt_logprobs[1:][top1_is_actual], atol=1e-5)


def test_single_token_prompt_scores_nothing(sampler_engine):
    res = run_sample(sampler_engine, op(greedy(2), prompt=PROMPT[:1], prompt_logprobs=True, topk_prompt_logprobs=2))
    assert np.isnan(res.prompt_logprobs).all() and res.prompt_logprobs.shape == (1,)
    assert res.topk_prompt_logprobs[0].shape == (1, 2)


# --- token choice rules on hand-built distributions ------------------------------------------------


def draw(logits_v: torch.Tensor, n: int, temperature=1.0, top_k=-1, top_p=1.0, seed=0) -> np.ndarray:
    """n independent draws: n rows of the same logits, each with its own stream."""
    gens = [torch.Generator().manual_seed(seed * 100_000 + i) for i in range(n)]
    rules = RowRules.repeat(temperature, top_k, top_p, gens)
    return choose_tokens(logits_v[None, :].expand(n, -1).clone(), rules).numpy()


PROBS = torch.tensor([0.5, 0.3, 0.15, 0.05, 0.0])


def test_plain_sampling_follows_the_distribution():
    got = draw(PROBS.log(), 4000)
    freq = np.bincount(got, minlength=5) / 4000
    np.testing.assert_allclose(freq, PROBS.numpy(), atol=0.03)
    assert freq[4] == 0  # a zero-probability token never comes out


@pytest.mark.parametrize("kw", [dict(top_k=2), dict(top_p=0.8), dict(top_k=3, top_p=0.7)])
def test_top_k_and_top_p_keep_the_renormalised_head(kw):
    got = draw(PROBS.log(), 4000, **kw)
    freq = np.bincount(got, minlength=5) / 4000
    np.testing.assert_allclose(freq, [0.625, 0.375, 0, 0, 0], atol=0.03)


def test_temperature_sharpens():
    got = draw(PROBS.log(), 4000, temperature=0.5)  # p ** 2, renormalised
    want = PROBS**2 / (PROBS**2).sum()
    np.testing.assert_allclose(np.bincount(got, minlength=5) / 4000, want.numpy(), atol=0.03)


def test_nucleus_beyond_the_first_candidate_batch():
    """A flat 5000-token distribution: the 0.9 nucleus (4500 tokens) needs the candidate set grown."""
    logits = torch.linspace(0.0, -1e-3, 5000)  # strictly decreasing, nearly flat
    probs = torch.softmax(logits.double(), -1)
    m = int((probs.cumsum(-1) < 0.9).sum()) + 1  # nucleus size
    got = draw(logits, 2000, top_p=0.9)
    assert got.max() < m and got.max() > 4000


def test_greedy_rules_and_degenerate_truncation_match_argmax():
    logits = torch.randn(3, 1000, generator=torch.Generator().manual_seed(0))
    want = logits.argmax(-1)
    for t, k, p in [(0.0, -1, 1.0), (1e-7, -1, 1.0), (1.0, 1, 1.0), (1.0, -1, 1e-9), (2.0, 0, 1e-9)]:
        gens = [torch.Generator().manual_seed(i) for i in range(3)]
        assert torch.equal(choose_tokens(logits.clone(), RowRules.repeat(t, k, p, gens)), want)


def test_rows_with_different_top_k_in_one_batch():
    n = 3000
    logits = PROBS.log()[None, :].expand(2 * n, -1).clone()
    rules = RowRules(
        temperature=torch.ones(2 * n, dtype=torch.float64),
        top_k=torch.tensor([1] * n + [3] * n),
        top_p=torch.ones(2 * n, dtype=torch.float64),
        generators=[torch.Generator().manual_seed(i) for i in range(2 * n)],
    )
    got = choose_tokens(logits, rules).numpy()
    assert (got[:n] == 0).all()
    want = [0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0, 0]  # top 3 of PROBS, renormalised
    np.testing.assert_allclose(np.bincount(got[n:], minlength=5) / n, want, atol=0.03)


def test_inverse_cdf_never_picks_a_zero_probability_cell_at_the_extremes():
    probs = torch.tensor([[0.0, 0.25, 0.0, 0.75, 0.0]], dtype=torch.float64).expand(2, -1)
    u = torch.tensor([0.0, 1.0 - 2.0**-53], dtype=torch.float64)  # the ends of torch.rand's range
    assert _inverse_cdf(probs, u).tolist() == [3, 1]


@pytest.mark.parametrize("width", [49152, 5000, 2048])
def test_inverse_cdf_by_blocks_picks_what_one_cumulative_sum_picks(width):
    """The two-level search (block sums, then one block) against one long cumsum: peaked and flat
    rows, runs of zero-probability cells across whole blocks, a ragged last block, and the
    uniforms' extremes, where a zero cell must never come out."""
    gen = torch.Generator().manual_seed(width)
    logits = torch.randn(64, width, generator=gen, dtype=torch.float64) * torch.tensor([0.1, 3.0, 12.0, 30.0]).repeat(16)[:, None]
    probs = torch.exp(logits - logits.amax(-1, keepdim=True))
    probs[::3, : width // 2] = 0.0  # zero blocks before the mass
    probs[1::3, width // 3 :] = 0.0  # and after it
    probs[2::3, 1000:1100] = 0.0  # inside a block and across a block boundary
    u = torch.rand(64, generator=gen, dtype=torch.float64)
    u[:4] = torch.tensor([0.0, 1.0 - 2.0**-53, 0.0, 1.0 - 2.0**-53], dtype=torch.float64)
    cdf = probs.cumsum(-1)
    want = torch.searchsorted(cdf, ((1.0 - u) * cdf[:, -1])[:, None]).squeeze(1)
    got = _inverse_cdf(probs, u)
    assert torch.equal(got, want)
    assert (probs.gather(1, got[:, None]) > 0).all()


def test_mixed_rows_in_one_batch():
    """Rows with different rules in one call each follow their own rule (the fused-batch case)."""
    n = 3000
    logits = PROBS.log()[None, :].expand(3 * n, -1).clone()
    rules = RowRules(
        temperature=torch.tensor([0.0] * n + [1.0] * n + [1.0] * n, dtype=torch.float64),
        top_k=torch.tensor([-1] * n + [2] * n + [-1] * n),
        top_p=torch.tensor([1.0] * 2 * n + [0.8] * n, dtype=torch.float64),
        generators=[torch.Generator().manual_seed(i) for i in range(3 * n)],
    )
    got = choose_tokens(logits, rules).numpy()
    assert (got[:n] == 0).all()
    for part in (got[n : 2 * n], got[2 * n :]):
        np.testing.assert_allclose(np.bincount(part, minlength=5) / n, [0.625, 0.375, 0, 0, 0], atol=0.03)


# --- adapters from checkpoint paths ----------------------------------------------------------------


def test_sampler_checkpoint_is_loaded_once_and_reloaded_when_resaved(
    sampler_engine, sampler_adapters, tmp_path, monkeypatch
):
    """A PEFT directory written by checkpoints.save_adapter samples like the adapter it came from."""
    from tinkerd.engine import checkpoints

    rt = sampler_engine.runtime(TINY)
    reads: list[str] = []
    real_read = checkpoints.read_adapter_from

    def spy(store, key):
        reads.append(key)
        return real_read(store, key)

    monkeypatch.setattr(checkpoints, "read_adapter_from", spy)
    path = str(tmp_path / "sampler_weights" / "s1")
    checkpoints.save_adapter(rt.pool.get(sampler_adapters[1]), TINY, path, with_optimizer=False)
    o = replace(op(greedy(6)), adapter_path=path)
    first = run_sample(sampler_engine, o).sequences[0].tokens
    assert run_sample(sampler_engine, o).sequences[0].tokens == first
    assert reads == [path]  # cached in the pool, keyed by the path
    assert first == run_with_slot(sampler_engine, sampler_adapters[1], op(greedy(6))).sequences[0].tokens
    assert rt.pool.get(path).trainable is False
    # Re-saved under the same path with other weights (the fresh adapter = the base model).
    checkpoints.save_adapter(rt.pool.get(sampler_adapters[0]), TINY, path, with_optimizer=False)
    resaved = run_sample(sampler_engine, o).sequences[0].tokens
    assert reads == [path, path]
    assert resaved == run_sample(sampler_engine, op(greedy(6))).sequences[0].tokens != first
    rt.pool.remove(path)


def test_missing_adapter_path_is_not_found(sampler_engine, tmp_path):
    with pytest.raises(NotFoundError):
        run_sample(sampler_engine, replace(op(greedy(2)), adapter_path=str(tmp_path / "nope")))


# --- validation ------------------------------------------------------------------------------------


BAD = {
    "empty prompt": op(greedy(2), prompt=np.array([], dtype=np.int64)),
    "2-D prompt": op(greedy(2), prompt=PROMPT[None, :]),
    "float prompt": op(greedy(2), prompt=PROMPT.astype(np.float32)),
    "negative id": op(greedy(2), prompt=np.array([5, -1])),
    "id >= vocab": op(greedy(2), prompt=np.array([5, 151669])),
    "over context": op(greedy(4096 - len(PROMPT) + 1)),
    "max_tokens 0": op(greedy(0)),
    "num_samples 0": op(greedy(2), num_samples=0),
    "top_k -2": op(SamplingParams(max_tokens=2, top_k=-2)),
    "top_p 0": op(SamplingParams(max_tokens=2, top_p=0.0)),
    "top_p > 1": op(SamplingParams(max_tokens=2, top_p=1.01)),
    "top_p nan": op(SamplingParams(max_tokens=2, top_p=float("nan"))),
    "temperature < 0": op(SamplingParams(max_tokens=2, temperature=-0.1)),
    "temperature inf": op(SamplingParams(max_tokens=2, temperature=float("inf"))),
    "topk prompt > vocab": op(greedy(2), topk_prompt_logprobs=151670),
    "topk prompt < 0": op(greedy(2), topk_prompt_logprobs=-1),
    "topk sample > vocab": op(greedy(2), topk_sample_logprobs=151670),
    "topk sample < 0": op(greedy(2), topk_sample_logprobs=-1),
    "topk prompt pairs > cap": op(greedy(2), topk_prompt_logprobs=MAX_TOPK_PAIRS // 7 + 1),  # 7 scored positions
    "topk sample pairs > cap": op(greedy(8), num_samples=2, topk_sample_logprobs=MAX_TOPK_PAIRS // 16 + 1),
    "last_n 0": op(greedy(2), prompt_logprobs=True, prompt_logprobs_last_n=0),
    "empty stop seq": op(greedy(2, stop_token_seqs=((),))),
    "empty stop string": op(greedy(2, stop_strings=("",))),
    "unknown base model": replace(op(greedy(2)), base_model="nope/nope"),
}


@pytest.mark.parametrize("name", list(BAD))
def test_validation_errors_are_user_errors_and_touch_nothing(sampler_engine, name, tmp_path, monkeypatch):
    rt = sampler_engine.runtime(TINY)
    adapters_before = set(rt.pool.adapters)

    def touched(*a):
        raise AssertionError("the adapter was read before validation")

    monkeypatch.setattr(adapters_mod, "_read_adapter", touched)
    with pytest.raises(UserError) as err:
        run_sample(sampler_engine, replace(BAD[name], adapter_path=str(tmp_path)))
    assert type(err.value) is UserError and err.value.message
    assert set(rt.pool.adapters) == adapters_before and rt.ctx.groups == []


def test_edge_values_are_accepted(sampler_engine):
    """top_k 0 means off (as -1); the exact context limit, topk = vocab and the pairs cap pass validation."""
    validate(op(greedy(4096 - len(PROMPT)), topk_prompt_logprobs=151669, prompt_logprobs_last_n=6), 151669, 4096)
    validate(op(greedy(2), topk_prompt_logprobs=MAX_TOPK_PAIRS // 7), 10**9, 4096)
    validate(op(greedy(8), num_samples=2, topk_sample_logprobs=MAX_TOPK_PAIRS // 16), 10**9, 4096)
    a = run_sample(sampler_engine, op(SamplingParams(max_tokens=4, top_k=0, seed=2))).sequences[0]
    b = run_sample(sampler_engine, op(SamplingParams(max_tokens=4, top_k=-1, seed=2))).sequences[0]
    assert a.tokens == b.tokens


def test_engine_state_is_clean_after_a_failure_mid_decode(sampler_engine, monkeypatch):
    """An unexpected error inside the decode loop leaves no adapter routing behind."""
    rt = sampler_engine.runtime(TINY)

    def boom(*a, **k):
        raise RuntimeError("boom")

    monkeypatch.setattr(sample_mod, "choose_tokens", boom)
    with pytest.raises(ServerError, match="boom"):
        run_sample(sampler_engine, op(greedy(3)))
    assert rt.ctx.groups == [] and rt.ctx.sampling is False
