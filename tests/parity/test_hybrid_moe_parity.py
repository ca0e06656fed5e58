"""Qwen3.5-MoE (hybrid linear attention + routed experts + gated shared expert) equals HF + PEFT.

`tinkerd/tiny-qwen3.5-moe`: the layers of tiny-qwen3.5 (0-2 Gated DeltaNet, 3 gated attention)
with a MoE block in each (4 experts top-2, moe_intermediate 40, a shared expert of 48 behind a
sigmoid gate). LoRA on the DeltaNet and attention projections, every routed expert
(lora/experts.py, `Qwen3_5MoeExperts`), the shared expert's gate/up/down_proj and lm_head. The
oracle is PEFT `target_modules` + `target_parameters` (experts) in fp64, tinkerd in fp32, 1e-5 of
the largest reference value, as in test_moe_parity.py. The shared expert runs on the block's
flattened tokens [B * T, H], so a batch mixing tenants routes its LoRA by token, not by row
(SlotGroup.token_rows); the two-tenant test fails without that.
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from tests.parity.peft_oracle import (assert_forward_backward_matches, family_fixtures, logits, merged_generate,
                                      peft_reference, random_adapter)
from tests.parity.test_lora_parity import assert_close_scaled
from tinkerd.engine.sampler import sample as sample_mod
from tinkerd.engine.sampler.hybrid import HybridBatchCache
from tinkerd.engine.sampler.sample import Sampler, SamplerConfig
from tinkerd.types import LoraSpec, SampleOp, SamplingParams

HMOE = "tinkerd/tiny-qwen3.5-moe"
FULL = LoraSpec(rank=4, alpha=8.0, seed=41)
SECOND = LoraSpec(rank=2, alpha=4.0, seed=42)
adapter = functools.partial(random_adapter, base=HMOE)


hmoe_engine, hmoe_dir = family_fixtures(HMOE, "hmoe_engine", "hmoe_dir")


def test_logits_logprobs_and_grads_equal_peft(hmoe_engine, hmoe_dir):
    rt = hmoe_engine.runtime(HMOE)
    ad = adapter(hmoe_engine, "hm-full", FULL, seed=1)
    assert {n.removeprefix("model.layers.0.") for n in ad.weights if ".layers.0." in n} == {
        "linear_attn.in_proj_qkv", "linear_attn.in_proj_z", "linear_attn.out_proj", "mlp.experts.gate_up_proj",
        "mlp.experts.down_proj", "mlp.shared_expert.gate_proj", "mlp.shared_expert.up_proj", "mlp.shared_expert.down_proj"}
    reference = peft_reference(hmoe_dir, ad)
    ids = torch.randint(0, 151_000, (3, 10), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        theirs = reference(input_ids=ids).logits
    assert_close_scaled(logits(rt, ids, [ad.slot]), theirs, "logits")

    result = assert_forward_backward_matches(hmoe_engine, reference, ad, (9, 5))
    assert 0 < result.metrics["e_frac_with_tokens:mean"] <= 1  # the router metrics come with it


def test_two_tenants_in_one_batch_equal_each_alone(hmoe_engine):
    rt = hmoe_engine.runtime(HMOE)
    first = adapter(hmoe_engine, "hm-full", FULL, seed=1)
    second = adapter(hmoe_engine, "hm-second", SECOND, seed=3, scale=0.2)
    ids = torch.randint(0, 151_000, (3, 9), generator=torch.Generator().manual_seed(4))
    mixed = logits(rt, ids, [first.slot, second.slot, -1])
    for row, slot in enumerate([first.slot, second.slot, -1]):
        alone = logits(rt, ids[row:row + 1], [slot])[0]
        torch.testing.assert_close(mixed[row], alone, rtol=1e-6, atol=1e-5)
    assert (logits(rt, ids[:1], [first.slot]) - logits(rt, ids[:1], [second.slot])).abs().max() > 1e-2


def test_greedy_sampling_of_concurrent_tenants_equals_hf_generate_with_the_merged_adapter(hmoe_engine, hmoe_dir, monkeypatch):
    rt = hmoe_engine.runtime(HMOE)
    ads = [adapter(hmoe_engine, "hm-full", FULL, seed=1), adapter(hmoe_engine, "hm-second", SECOND, seed=3, scale=0.2)]
    prompts = [[9707, 11, 1879, 0, 220, 3555], [785, 6722, 315, 9625, 374, 12095, 13, 576, 1156]]
    monkeypatch.setattr(sample_mod, "acquire_adapter", lambda runtime, path, max_idle: runtime.pool.acquire(path))
    sampler = Sampler(rt, SamplerConfig(prefill_tokens_per_step=4))
    assert isinstance(sampler.cache, HybridBatchCache)
    params = SamplingParams(max_tokens=6, temperature=0.0, stop_at_eos=False)
    for i, (ad, prompt) in enumerate(zip(ads, prompts)):
        sampler.admit(i, SampleOp(base_model=HMOE, adapter_path=ad.key, prompt=np.array(prompt), params=params))
    done = {}
    while len(done) < 2:
        done.update(dict(sampler.step()))
    for i, (ad, prompt) in enumerate(zip(ads, prompts)):
        want, lps = merged_generate(hmoe_dir, ad, prompt, 6)
        (seq,) = done[i].sequences
        assert seq.tokens == want, i
        np.testing.assert_allclose(seq.logprobs, lps, atol=1e-4)
