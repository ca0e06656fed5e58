"""LoRA on every routed expert of a Qwen3-MoE (engine/lora/experts.py) equals HF + PEFT.

The oracle is PEFT's `target_parameters` LoRA on `mlp.experts.gate_up_proj` / `mlp.experts.down_proj`
(one adapter) plus `target_modules` for attention and lm_head, on the same tiny random-weight
Qwen3-MoE (4 experts, top-2, hidden 64 != 2 x moe_intermediate 40), with tinkerd's A/B copied in.
As in test_lora_parity.py the reference runs in fp64 and tinkerd in fp32, and the tolerance is
1e-5 of the largest reference value; the reference's experts run the eager loop (transformers'
default on CPU is grouped_mm, which has no fp64 kernel).
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch

from tests.parity.peft_oracle import (assert_forward_backward_matches, family_fixtures, logits, merged_generate,
                                      peft_reference, random_adapter, run)
from tests.parity.test_lora_parity import assert_close_scaled
from tinkerd.engine.sampler import sample as sample_mod
from tinkerd.engine.sampler.sample import Sampler
from tinkerd.types import Datum, ForwardBackwardOp, LoraSpec, SampleOp, SamplingParams

MOE = "tinkerd/tiny-qwen3-moe"
adapter = functools.partial(random_adapter, base=MOE)


moe_engine, moe_dir = family_fixtures(MOE, "moe_engine", "moe_dir")


FULL = LoraSpec(rank=4, alpha=8.0, seed=21)


def test_every_routed_expert_gets_lora_and_train_mlp_controls_it(moe_engine):
    full = adapter(moe_engine, "moe-full", FULL, seed=1)
    experts = {n: (tuple(a.shape), tuple(b.shape)) for n, (a, b) in full.weights.items() if ".experts." in n}
    # 2 layers x (gate_up_proj, down_proj), rank 4, per expert: A [E, R, in], B [E, out, R].
    assert experts == {
        **{f"model.layers.{i}.mlp.experts.gate_up_proj": ((4, 4, 64), (4, 80, 4)) for i in range(2)},
        **{f"model.layers.{i}.mlp.experts.down_proj": ((4, 4, 40), (4, 64, 4)) for i in range(2)},
    }
    no_mlp = adapter(moe_engine, "moe-no-mlp", LoraSpec(rank=4, alpha=8.0, seed=22, train_mlp=False), seed=2)
    assert not any(".experts." in n for n in no_mlp.weights) and any("q_proj" in n for n in no_mlp.weights)


def test_logits_logprobs_and_grads_equal_peft_target_parameters(moe_engine, moe_dir):
    rt = moe_engine.runtime(MOE)
    ad = adapter(moe_engine, "moe-full", FULL, seed=1)
    reference = peft_reference(moe_dir, ad)
    ids = torch.randint(0, 151_000, (3, 10), generator=torch.Generator().manual_seed(0))
    ours = logits(rt, ids, [ad.slot])
    with torch.no_grad():
        theirs = reference(input_ids=ids).logits
    assert_close_scaled(ours, theirs, "logits")
    # Not vacuous: the expert LoRA alone moves the logits (attention/lm_head LoRA switched off).
    only_experts = {n: lw for n, lw in rt.pool.layers.items() if ".experts." not in n}
    saved = {n: layer.adapters.pop(ad.slot) for n, layer in only_experts.items()}
    try:
        assert (logits(rt, ids, [ad.slot]) - logits(rt, ids, [-1])).abs().max() > 1e-3
    finally:
        for n, lw in saved.items():
            rt.pool.layers[n].adapters[ad.slot] = lw

    assert_forward_backward_matches(moe_engine, reference, ad, (9, 5))


def test_two_tenants_in_one_batch_equal_each_alone(moe_engine):
    """fp32, to 1e-6 relative: the rows of one expert's tokens are split by slot, so a token's
    GEMMs run with a different row count than alone, which moves the last bits."""
    rt = moe_engine.runtime(MOE)
    first = adapter(moe_engine, "moe-full", FULL, seed=1)
    second = adapter(moe_engine, "moe-second", LoraSpec(rank=2, alpha=4.0, seed=23), seed=3, scale=0.2)
    assert all(any(".experts." in n for n in ad.weights) for ad in (first, second))  # routing through the experts layer
    ids = torch.randint(0, 151_000, (3, 9), generator=torch.Generator().manual_seed(4))
    mixed = logits(rt, ids, [first.slot, second.slot, -1])
    for row, slot in enumerate([first.slot, second.slot, -1]):
        alone = logits(rt, ids[row:row + 1], [slot])[0]
        torch.testing.assert_close(mixed[row], alone, rtol=1e-6, atol=1e-5)
    assert (logits(rt, ids[:1], [first.slot]) - logits(rt, ids[:1], [second.slot])).abs().max() > 1e-2


def test_greedy_sampling_of_two_tenants_equals_hf_generate_with_the_merged_adapter(moe_engine, moe_dir, monkeypatch):
    rt = moe_engine.runtime(MOE)
    ads = [adapter(moe_engine, "moe-full", FULL, seed=1),
           adapter(moe_engine, "moe-second", LoraSpec(rank=2, alpha=4.0, seed=23), seed=3, scale=0.2)]
    prompts = [[9707, 11, 1879, 0, 220, 3555], [785, 6722, 315, 9625, 374, 12095, 13]]
    assert all(any(".experts." in n for n in ad.weights) for ad in ads)
    # Both requests in one decode batch, each with its own adapter (no checkpoint dir needed).
    monkeypatch.setattr(sample_mod, "acquire_adapter", lambda runtime, path, max_idle: runtime.pool.acquire(path))
    sampler = Sampler(rt, moe_engine.sampler_config)
    params = SamplingParams(max_tokens=6, temperature=0.0, stop_at_eos=False)
    for i, (ad, prompt) in enumerate(zip(ads, prompts)):
        sampler.admit(i, SampleOp(base_model=MOE, adapter_path=ad.key, prompt=np.array(prompt), params=params))
    done = {}
    while len(done) < 2:
        done.update(dict(sampler.step()))
    for i, (ad, prompt) in enumerate(zip(ads, prompts)):
        want_tokens, want_lps = merged_generate(moe_dir, ad, prompt, 6)
        (seq,) = done[i].sequences
        assert seq.tokens == want_tokens, i
        np.testing.assert_allclose(seq.logprobs, want_lps, atol=1e-4)


def test_router_metrics_on_forward_backward_follow_the_sdk_definitions(moe_engine, moe_dir):
    """e_* metrics counted over the real tokens only (a padded row's pad positions route too),
    pinned against HF's own router logits of the base model, top-2 per token, per layer."""
    ad = adapter(moe_engine, "moe-full", FULL, seed=1)
    rng = np.random.default_rng(7)
    seqs = [rng.integers(0, 151_000, n + 1) for n in (11, 4)]
    data = [Datum(tokens=s[:-1], loss_fn_inputs={"target_tokens": s[1:]}) for s in seqs]
    got = run(moe_engine, ForwardBackwardOp(ad.key, data, "cross_entropy", forward_only=True)).metrics

    # The reference: the router sees the layer's input, which the adapter's attention LoRA changes,
    # so use PEFT's model with the same adapter, one unpadded sequence at a time.
    reference = peft_reference(moe_dir, ad, dtype=torch.float64)
    counts = torch.zeros(2, 4, dtype=torch.float64)
    for s in seqs:
        with torch.no_grad():
            out = reference(input_ids=torch.from_numpy(s[:-1])[None], output_router_logits=True)
        for layer, logits in enumerate(out.router_logits):  # [T, E]
            top = torch.topk(torch.softmax(logits, -1), 2, dim=-1).indices
            counts[layer] += torch.bincount(top.flatten(), minlength=4)
    fair = counts.sum(1, keepdim=True) / 4
    assert counts.sum().item() == 2 * 2 * 15  # 2 layers x 15 real tokens x top-2
    want = {
        "e_frac_with_tokens:mean": (counts > 0).double().mean().item(),
        "e_frac_oversubscribed:mean": (counts > fair).double().mean().item(),
        "e_max_violation:mean": ((counts.max(1).values - fair[:, 0]) / fair[:, 0]).mean().item(),
        "e_max_violation:max": ((counts.max(1).values - fair[:, 0]) / fair[:, 0]).max().item(),
        "e_min_violation:mean": ((counts.min(1).values - fair[:, 0]) / fair[:, 0]).mean().item(),
    }
    assert {k: got[k] for k in want} == pytest.approx(want)
    assert want["e_max_violation:max"] > 0  # a skewed routing, so the numbers say something
