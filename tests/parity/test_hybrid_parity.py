"""Qwen3.5 (hybrid linear attention) with LoRA equals HF + PEFT, and its sampler equals HF generate.

The model is `tinkerd/tiny-qwen3.5` (engine/model/tiny.py): 4 layers, 0-2 Gated DeltaNet and 3
gated full attention, built from a config and a seed. LoRA sits on the DeltaNet projections
(`in_proj_qkv`, `in_proj_z`, `out_proj`), the gated attention's q/k/v/o, the MLP and lm_head; the
DeltaNet kernels are transformers' PyTorch fallbacks. The oracle is PEFT `target_modules` with
tinkerd's A/B copied in, in fp64 (tinkerd fp32), tolerance 1e-5 of the largest reference value
as in test_lora_parity.py. The sampler keeps per-row conv and recurrent states for the DeltaNet
layers (sampler/hybrid.py); it is pinned against HF `generate` on the merged adapter.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.parity.peft_oracle import (assert_forward_backward_matches, family_fixtures, logits, merged_generate,
                                      peft_reference, random_adapter)
from tests.parity.test_lora_parity import assert_close_scaled
from tinkerd.engine.sampler import sample as sample_mod
from tinkerd.engine.sampler.hybrid import HybridBatchCache, state_bytes_per_row
from tinkerd.engine.sampler.sample import Sampler, SamplerConfig
from tinkerd.types import LoraSpec, SampleOp, SamplingParams

HYBRID = "tinkerd/tiny-qwen3.5"
LINEAR = ("in_proj_qkv", "in_proj_z", "out_proj")
FULL = LoraSpec(rank=4, alpha=8.0, seed=31)
SECOND = LoraSpec(rank=2, alpha=4.0, seed=32, train_mlp=False)
adapter = functools.partial(random_adapter, base=HYBRID)


hybrid_engine, hybrid_dir = family_fixtures(HYBRID, "hybrid_engine", "hybrid_dir")


def test_lora_lands_on_the_deltanet_and_gated_attention_projections(hybrid_engine):
    rt = hybrid_engine.runtime(HYBRID)
    assert rt.model.config.layer_types == ["linear_attention"] * 3 + ["full_attention"]
    ad = adapter(hybrid_engine, "hy-full", FULL, seed=1)
    shapes = {n: (tuple(a.shape), tuple(b.shape)) for n, (a, b) in ad.weights.items() if ".layers.0." in n or ".layers.3." in n}
    # DeltaNet: in_proj_qkv out = 2 x key_dim (2 x 8) + value_dim (4 x 16) = 96; in_proj_z = value_dim.
    assert {n: s for n, s in shapes.items() if "linear_attn" in n} == {
        "model.layers.0.linear_attn.in_proj_qkv": ((4, 64), (96, 4)),
        "model.layers.0.linear_attn.in_proj_z": ((4, 64), (64, 4)),
        "model.layers.0.linear_attn.out_proj": ((4, 64), (64, 4)),
    }
    # Gated attention: q_proj is query plus output gate, 2 x 4 heads x 16.
    assert shapes["model.layers.3.self_attn.q_proj"] == ((4, 64), (128, 4))
    assert not any(n.endswith(("in_proj_a", "in_proj_b")) for n in ad.weights)


def test_logits_logprobs_and_grads_equal_peft(hybrid_engine, hybrid_dir):
    rt = hybrid_engine.runtime(HYBRID)
    ad = adapter(hybrid_engine, "hy-full", FULL, seed=1)
    reference = peft_reference(hybrid_dir, ad)
    ids = torch.randint(0, 151_000, (3, 10), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        theirs = reference(input_ids=ids).logits
    assert_close_scaled(logits(rt, ids, [ad.slot]), theirs, "logits")
    # Not vacuous: the DeltaNet LoRA alone moves the logits.
    others = {n: layer for n, layer in rt.pool.layers.items() if not n.endswith(LINEAR)}
    saved = {n: layer.adapters.pop(ad.slot) for n, layer in others.items() if ad.slot in layer.adapters}
    try:
        assert (logits(rt, ids, [ad.slot]) - logits(rt, ids, [-1])).abs().max() > 1e-3
    finally:
        for n, lw in saved.items():
            others[n].adapters[ad.slot] = lw

    assert_forward_backward_matches(hybrid_engine, reference, ad, (9, 5))  # different lengths: the batch is padded


def test_two_tenants_in_one_batch_equal_each_alone(hybrid_engine):
    """Bit-identical is not promised: the chunked delta rule's matmuls run over [B, ...] batches
    whose size differs from alone, which moves the last bits (fp32, 1e-6 relative)."""
    rt = hybrid_engine.runtime(HYBRID)
    first = adapter(hybrid_engine, "hy-full", FULL, seed=1)
    second = adapter(hybrid_engine, "hy-second", SECOND, seed=3, scale=0.2)
    ids = torch.randint(0, 151_000, (3, 9), generator=torch.Generator().manual_seed(4))
    mixed = logits(rt, ids, [first.slot, second.slot, -1])
    for row, slot in enumerate([first.slot, second.slot, -1]):
        alone = logits(rt, ids[row:row + 1], [slot])[0]
        torch.testing.assert_close(mixed[row], alone, rtol=1e-6, atol=1e-5)
    assert (logits(rt, ids[:1], [first.slot]) - logits(rt, ids[:1], [second.slot])).abs().max() > 1e-2


PROMPTS = [[9707, 11, 1879, 0, 220, 3555], [785, 6722, 315, 9625, 374, 12095, 13, 576, 1156, 3283, 374], [17]]


def test_greedy_sampling_of_concurrent_tenants_equals_hf_generate_with_the_merged_adapter(hybrid_engine, hybrid_dir, monkeypatch):
    """Three requests of prompt lengths 6, 11 and 1 in one decode batch, two adapters and the base
    model, 8 greedy steps each; a prefill budget of 4 tokens splits the long prompt over three
    steps (the DeltaNet states carry across prefill chunks) and makes the rows join the batch at
    different steps, so rows join and leave around each other's states."""
    rt = hybrid_engine.runtime(HYBRID)
    ads = [adapter(hybrid_engine, "hy-full", FULL, seed=1), adapter(hybrid_engine, "hy-second", SECOND, seed=3, scale=0.2), None]
    monkeypatch.setattr(sample_mod, "acquire_adapter", lambda runtime, path, max_idle: runtime.pool.acquire(path) if path else None)
    sampler = Sampler(rt, SamplerConfig(prefill_tokens_per_step=4))
    assert isinstance(sampler.cache, HybridBatchCache)
    lengths = [8, 8, 5]
    for i, (ad, prompt, n) in enumerate(zip(ads, PROMPTS, lengths)):
        params = SamplingParams(max_tokens=n, temperature=0.0, stop_at_eos=False)
        sampler.admit(i, SampleOp(base_model=HYBRID, adapter_path=ad.key if ad else None, prompt=np.array(prompt),
                                  params=params, prompt_logprobs=True))
    done, max_rows, state_bytes = {}, 0, []
    while len(done) < 3:
        done.update(dict(sampler.step()))
        max_rows = max(max_rows, len(sampler.rows))
        state_bytes.append(sampler.kv_cache_bytes())
    assert max_rows == 3
    per_row = state_bytes_per_row(rt.model.config, torch.float32)
    assert per_row == 3 * (96 * 4 + 4 * 8 * 16) * 4
    for i, (ad, prompt, n) in enumerate(zip(ads, PROMPTS, lengths)):
        if ad is None:
            merged = AutoModelForCausalLM.from_pretrained(hybrid_dir, dtype=torch.float32).eval()
            with torch.no_grad():
                ids = torch.tensor([prompt])
                out = merged.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                                      output_logits=True, return_dict_in_generate=True, eos_token_id=None,
                                      pad_token_id=151643)
            want_tokens = out.sequences[0, len(prompt):].tolist()
            want_lps = np.array([torch.log_softmax(s[0].float(), -1)[t].item() for s, t in zip(out.logits, want_tokens)])
        else:
            want_tokens, want_lps = merged_generate(hybrid_dir, ad, prompt, n)
        (seq,) = done[i].sequences
        assert seq.tokens == want_tokens, i
        np.testing.assert_allclose(seq.logprobs, want_lps, atol=1e-4)
        # Sampled logprobs equal the trainer's forward (compute_logprobs) of prompt + tokens, and
        # the prompt logprobs equal its prompt part.
        full = np.array(prompt + seq.tokens)
        slot = ad.slot if ad else -1
        lp = torch.log_softmax(logits(rt, torch.from_numpy(full)[None], [slot])[0], -1)
        scored = lp[:-1].gather(-1, torch.from_numpy(full[1:])[:, None])[:, 0].numpy()
        np.testing.assert_allclose(seq.logprobs, scored[len(prompt) - 1:], atol=1e-4)
        np.testing.assert_allclose(done[i].prompt_logprobs[1:], scored[:len(prompt) - 1], atol=1e-4)


def test_the_kv_budget_counts_the_linear_attention_states(hybrid_engine):
    """A budget that holds the request's KV columns but not its rows' states refuses it."""
    rt = hybrid_engine.runtime(HYBRID)
    probe = Sampler(rt, SamplerConfig())
    kv = 3 * (6 + 4) * probe.kv_token_bytes  # 3 samples x (prompt 6 + max_tokens 4) positions
    sampler = Sampler(rt, SamplerConfig(kv_cache_bytes=kv + probe.row_state_bytes))
    op = SampleOp(base_model=HYBRID, adapter_path=None, prompt=np.array(PROMPTS[0]), num_samples=3,
                  params=SamplingParams(max_tokens=4, temperature=0.0))
    with pytest.raises(Exception, match="linear-attention state"):
        sampler.admit("too-big", op)
    Sampler(rt, SamplerConfig(kv_cache_bytes=kv + 3 * probe.row_state_bytes)).admit("fits", op)
