"""Datums that share their first tokens run them once (engine/prefixes.py), with the plain pass's
numbers: loss, per-token logprobs and LoRA gradients within fp32 rounding of the same datums as one
padded batch, for an RL loss (GRPO-shaped groups) and cross-entropy, forward and forward_backward."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tinkerd.engine import buckets, cotrain, prefixes, training
from tinkerd.types import Datum, ForwardBackwardOp

from tests import grpo
from tests.parity.test_lora_parity import assert_close_scaled
from tests.unit.engine.test_training import adapter_of, create, run, sft_datum

VOCAB = 150_000
MIN_SAVED = prefixes.MIN_SAVED


def grpo_data(seed: int, prompts=(40, 28), samples: int = 4, completion=(6, 11)) -> list[Datum]:
    """`samples` datums per prompt (tests/grpo.py)."""
    rng = np.random.default_rng(seed)
    return [Datum(tokens=t, loss_fn_inputs=i) for p in prompts
            for t, i in grpo.samples(rng, rng.integers(0, VOCAB, p), samples, completion)]


def test_the_plan_groups_datums_by_their_shared_prefix():
    data = grpo_data(0)
    groups = prefixes.plan(data)
    assert [g.members for g in groups] == [(0, 1, 2, 3), (4, 5, 6, 7)]
    # The prompt, plus any first completion tokens every sample happens to share (none here).
    assert [g.prefix for g in groups] == [40, 28]
    # Nothing shared: no plan.
    assert prefixes.plan([sft_datum(np.random.default_rng(i).integers(0, VOCAB, 60)) for i in range(4)]) is None
    # Shared, but too little of the batch to be worth it: 16 tokens of 200-token datums.
    rng = np.random.default_rng(1)
    head = rng.integers(0, VOCAB, 16)
    few = [sft_datum(np.concatenate([head, rng.integers(0, VOCAB, 185)])) for _ in range(4)]
    assert prefixes.plan(few) is None
    # A datum that shares nothing rides along alone, split where it pads no prefix.
    lone = sft_datum(np.random.default_rng(7).integers(0, VOCAB, 90))
    groups = prefixes.plan(data + [lone])
    assert sorted(g.members for g in groups) == [(0, 1, 2, 3), (4, 5, 6, 7), (8,)]
    assert {g.members: g.prefix for g in groups}[(8,)] == 40
    # A group does not take in a datum that would shrink what it saves: three datums that share a
    # 20-token system prompt with the first group, then 30 tokens of their own, form their own group.
    system, own = data[0].tokens[:20], rng.integers(0, VOCAB, 30)
    mixed = data[:4] + [sft_datum(np.concatenate([system, own, rng.integers(0, VOCAB, 9)])) for _ in range(3)]
    assert sorted((g.members, g.prefix) for g in prefixes.plan(mixed)) == [((0, 1, 2, 3), 40), ((4, 5, 6), 50)]


def _pass(engine, model_id, data, shared: bool, monkeypatch, loss: str = "importance_sampling",
          forward_only: bool = False):
    monkeypatch.setattr(prefixes, "MIN_SAVED", MIN_SAVED if shared else 2.0)
    calls = []
    hook = engine.runtime_of(model_id).model.get_decoder().register_forward_hook(lambda *_: calls.append(1))
    try:
        result = run(engine, ForwardBackwardOp(model_id, data, loss, forward_only=forward_only))
    finally:
        hook.remove()
    adapter = adapter_of(engine, model_id)
    grads = [None if t.grad is None else t.grad.clone() for t in adapter.parameters()]
    for t in adapter.parameters():
        t.grad = None
    adapter.pending_grads = 0
    return len(calls), result, grads


def _assert_same(got, want, got_grads, want_grads):
    assert got.metrics["loss:sum"] == pytest.approx(want.metrics["loss:sum"], rel=1e-5, abs=1e-5)
    assert len(got.loss_fn_outputs) == len(want.loss_fn_outputs)
    for a, b in zip(got.loss_fn_outputs, want.loss_fn_outputs):
        assert a["logprobs"].shape == b["logprobs"].shape
        np.testing.assert_allclose(a["logprobs"], b["logprobs"], rtol=1e-5, atol=1e-5)
    for a, b in zip(got_grads, want_grads):
        if b is None:
            assert a is None
        else:
            assert_close_scaled(a, b, "a LoRA gradient")


@pytest.mark.parametrize("loss", ["importance_sampling", "cross_entropy"])
def test_grpo_groups_run_their_prompt_once_with_the_plain_passs_numbers(engine, monkeypatch, loss):
    data = grpo_data(3)
    if loss == "cross_entropy":  # every position weighted: the prompt's rows carry gradient too
        data = [sft_datum(np.concatenate([d.tokens, d.loss_fn_inputs["target_tokens"][-1:]])) for d in data]
    create(engine, f"prefix-{loss}", seed=5)
    head_rows = []
    real_head = training.HeadPass
    monkeypatch.setattr(training, "HeadPass", lambda rt, hidden, *a, **k: head_rows.append(len(hidden)) or real_head(rt, hidden, *a, **k))
    n_shared, got, got_grads = _pass(engine, f"prefix-{loss}", data, True, monkeypatch, loss)
    monkeypatch.setattr(training, "HeadPass", real_head)
    # The head's rows: each prompt's positions but its last once (their targets agree), then per
    # sample its last prompt position (its own first token as target) and its completion.
    groups = prefixes.plan(data)
    assert head_rows == [sum(g.prefix - 1 + sum(len(data[i].tokens) - g.prefix + 1 for i in g.members) for g in groups)]
    n_plain, want, want_grads = _pass(engine, f"prefix-{loss}", data, False, monkeypatch, loss)
    # Two decoder calls (the prompts, then the completions) against one padded batch.
    assert (n_shared, n_plain) == (2, 1)
    assert any(g is not None and g.abs().max() > 0 for g in want_grads)
    _assert_same(got, want, got_grads, want_grads)
    # The same op again runs the same calls: a replay after a crash gives the same bits.
    _, again, again_grads = _pass(engine, f"prefix-{loss}", data, True, monkeypatch, loss)
    assert again.metrics == got.metrics
    assert all(torch.equal(a, b) for a, b in zip(again_grads, got_grads) if b is not None)
    # A prefix-shared op does not share a pass with other runs.
    assert cotrain.pass_key(engine, ForwardBackwardOp(f"prefix-{loss}", data, loss)) is None


def test_forward_only_and_targets_that_differ_inside_the_prefix(engine, monkeypatch):
    """A group's prefix rows whose targets differ between its datums get a head row per datum: here
    two samples of each prompt are scored against other targets at some prompt positions."""
    data = grpo_data(4, prompts=(36, 30, 24), samples=3, completion=(3, 20))
    for i in (1, 5):
        t = data[i].loss_fn_inputs["target_tokens"].copy()
        t[[2, 17]] = (t[[2, 17]] + 1) % VOCAB
        data[i] = Datum(tokens=data[i].tokens, loss_fn_inputs={**data[i].loss_fn_inputs, "target_tokens": t})
    create(engine, "prefix-forward", seed=6)
    for forward_only in (True, False):
        n_shared, got, got_grads = _pass(engine, "prefix-forward", data, True, monkeypatch, forward_only=forward_only)
        n_plain, want, want_grads = _pass(engine, "prefix-forward", data, False, monkeypatch, forward_only=forward_only)
        assert (n_shared, n_plain) == (2, 1)
        _assert_same(got, want, got_grads, want_grads)
        assert forward_only == all(g is None for g in got_grads)


def test_suffixes_of_very_different_lengths_go_in_buckets(engine, monkeypatch):
    """Completions from 3 to 400 tokens: the suffixes' pass is cut into length buckets, with the plain
    pass's numbers."""
    rng = np.random.default_rng(8)
    prompt = rng.integers(0, VOCAB, 200)
    completions = (3, 400, 9, 380, 5, 7, 390, 4)
    data = [sft_datum(np.concatenate([prompt, rng.integers(0, VOCAB, n + 1)])) for n in completions]
    assert prefixes.plan(data) is not None
    create(engine, "prefix-ragged", seed=7)
    n_shared, got, got_grads = _pass(engine, "prefix-ragged", data, True, monkeypatch, "cross_entropy")
    n_plain, want, want_grads = _pass(engine, "prefix-ragged", data, False, monkeypatch, "cross_entropy")
    assert n_shared == 1 + len(buckets.plan(list(completions)))  # the prompt, then each bucket of completions
    _assert_same(got, want, got_grads, want_grads)


def test_soft_targets_share_the_rows_whose_candidates_agree(engine, monkeypatch):
    """target_tokens [N, K] (cross-entropy's soft targets): a prompt position is one head row when
    every datum of the group has the same K candidates there; one datum differs at one candidate."""
    rng = np.random.default_rng(11)
    prompt, k = rng.integers(0, VOCAB, 30), 3
    candidates = rng.integers(0, VOCAB, (29, k))  # the prompt's positions but its last
    data = []
    for s in range(4):
        seq = np.concatenate([prompt, rng.integers(0, VOCAB, 8)])
        targets = np.concatenate([candidates, rng.integers(0, VOCAB, (len(seq) - 29, k))])
        if s == 2:
            targets = targets.copy()
            targets[10, 1] = (targets[10, 1] + 1) % VOCAB
        data.append(Datum(tokens=seq, loss_fn_inputs={"target_tokens": targets,
                                                      "weights": rng.random(targets.shape).astype(np.float32)}))
    groups = prefixes.plan(data)
    assert [(g.prefix, g.members) for g in groups] == [(30, (0, 1, 2, 3))]
    create(engine, "prefix-soft", seed=8)
    n_shared, got, got_grads = _pass(engine, "prefix-soft", data, True, monkeypatch, "cross_entropy")
    n_plain, want, want_grads = _pass(engine, "prefix-soft", data, False, monkeypatch, "cross_entropy")
    assert (n_shared, n_plain) == (2, 1)
    _assert_same(got, want, got_grads, want_grads)


@pytest.mark.parametrize("base", ["tinkerd/tiny-llama", "tinkerd/tiny-qwen3-moe", "tinkerd/tiny-qwen3.5", "tinkerd/tiny-qwen3-vl"])
def test_llama_shares_the_prompt_and_moe_hybrid_and_vlm_keep_the_plain_pass(engine, monkeypatch, base):
    """Llama shares the prompt with the plain pass's numbers; an MoE, a hybrid linear-attention and a
    vision-language model keep the plain pass (their bodies are laid out by one padded batch)."""
    from tinkerd.types import CreateModelOp, LoraSpec, UnloadModelOp

    engine.load_base_models([base])
    model_id = f"prefix-{base.rsplit('/', 1)[1]}"
    run(engine, CreateModelOp(model_id, base, LoraSpec(rank=8, alpha=32.0, seed=9)))
    data = grpo_data(12)
    try:
        n_shared, got, got_grads = _pass(engine, model_id, data, True, monkeypatch)
        n_plain, want, want_grads = _pass(engine, model_id, data, False, monkeypatch)
    finally:  # the session's engine is shared: later tests count the adapters resident on it
        run(engine, UnloadModelOp(model_id))
    assert (n_shared, n_plain) == ((2, 1) if base == "tinkerd/tiny-llama" else (1, 1))
    _assert_same(got, want, got_grads, want_grads)


def test_the_suffixes_read_the_prompts_keys_and_values_with_their_heads_grouped(engine, monkeypatch):
    """The suffixes' attention over their cached prompt (more keys than queries, under a mask) takes
    the key/value heads grouped, as torch's CPU kernel allows: HF's call would widen them to the query
    heads (repeat_kv), which on SmolLM2's GRPO shape cost ~1.3 s of a 13.7 s forward_backward."""
    from transformers.integrations import sdpa_attention as hf

    config = engine.runtime("tinkerd/tiny-qwen3").model.config
    assert config.num_key_value_heads < config.num_attention_heads  # the tiny model groups its heads
    widened = []
    real = hf.repeat_kv
    monkeypatch.setattr(hf, "repeat_kv", lambda x, n: widened.append(tuple(x.shape)) or real(x, n))
    data = grpo_data(13)
    create(engine, "prefix-grouped", seed=14)
    n_shared, got, got_grads = _pass(engine, "prefix-grouped", data, True, monkeypatch)
    # The prompts' own pass (square, 40 tokens: below the engine's blocks) may still widen; no call
    # over the cached prompt plus a suffix (more than the widest prompt's 40 keys) does.
    widest = max(g.prefix for g in prefixes.plan(data))
    assert n_shared == 2 and widest == 40 and [s for s in widened if s[2] > widest] == []
    n_plain, want, want_grads = _pass(engine, "prefix-grouped", data, False, monkeypatch)
    _assert_same(got, want, got_grads, want_grads)
