"""gpt-oss (GptOss* classes of transformers 5.24) served by tinkerd equals HF + PEFT.

The tiny model (`tinkerd/tiny-gpt-oss`): 2 layers, layer 0 sliding-window attention (window 8),
layer 1 full; learned attention sinks; 4 experts top-2 whose fused gate_up_proj [E, H, 2I]
interleaves gate and up columns, with biases and a clamped SwiGLU; a router with a bias; YaRN rope.
The oracle is PEFT `target_modules` (q/k/v/o_proj, lm_head) + `target_parameters`
(mlp.experts.gate_up_proj / down_proj) with tinkerd's A/B copied in (B re-ordered to the
interleaved rows, peft_oracle.py), in fp64 against tinkerd's fp32, to 1e-5 of the largest reference
value, as for Qwen3-MoE. Sequences are longer than the window, so the sliding layer's mask matters.
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from tests.parity.peft_oracle import (assert_forward_backward_matches, family_fixtures, logits, merged_generate,
                                      peft_reference, random_adapter, run)
from tests.parity.test_lora_parity import assert_close_scaled
from tinkerd.engine.engine import Engine
from tinkerd.engine.sampler import sample as sample_mod
from tinkerd.engine.sampler.sample import Sampler
from tinkerd.types import Datum, ForwardBackwardOp, LoraSpec, SampleOp, SamplingParams

GPT_OSS = "tinkerd/tiny-gpt-oss"
adapter = functools.partial(random_adapter, base=GPT_OSS)
FULL = LoraSpec(rank=4, alpha=8.0, seed=31)
SECOND = LoraSpec(rank=2, alpha=4.0, seed=32)
VOCAB = 151_669  # the Qwen3 tokens; the 7 Harmony tokens after them are left out of random ids


engine, model_dir = family_fixtures(GPT_OSS, "engine", "model_dir")


def test_lora_lands_on_attention_every_expert_and_lm_head_not_sinks_or_router(engine):
    ad = adapter(engine, "full", FULL, seed=1)
    shapes = {n: (tuple(a.shape), tuple(b.shape)) for n, (a, b) in ad.weights.items() if ".layers.0." in n}
    # A [E, R, in], B [E, out, R] per expert, though gpt-oss stores the weights [E, in, out].
    assert shapes == {
        "model.layers.0.self_attn.q_proj": ((4, 64), (64, 4)),
        "model.layers.0.self_attn.k_proj": ((4, 64), (32, 4)),
        "model.layers.0.self_attn.v_proj": ((4, 64), (32, 4)),
        "model.layers.0.self_attn.o_proj": ((4, 64), (64, 4)),
        "model.layers.0.mlp.experts.gate_up_proj": ((4, 4, 64), (4, 80, 4)),
        "model.layers.0.mlp.experts.down_proj": ((4, 4, 40), (4, 64, 4)),
    }
    assert "lm_head" in ad.weights and not any("router" in n or "sinks" in n for n in ad.weights)
    rt = engine.runtime(GPT_OSS)
    assert not any(p.requires_grad for p in rt.model.parameters())  # sinks, router, biases: frozen


def test_logits_logprobs_loss_and_grads_equal_peft(engine, model_dir):
    rt = engine.runtime(GPT_OSS)
    ad = adapter(engine, "full", FULL, seed=1)
    reference = peft_reference(model_dir, ad)
    ids = torch.randint(0, VOCAB, (3, 20), generator=torch.Generator().manual_seed(0))
    ours = logits(rt, ids, [ad.slot])
    with torch.no_grad():
        theirs = reference(input_ids=ids).logits
    assert_close_scaled(ours, theirs, "logits")
    # Not vacuous: the experts' LoRA alone moves the logits, and so do the sinks and the window.
    saved = {n: layer.adapters.pop(ad.slot) for n, layer in rt.pool.layers.items() if ".experts." not in n}
    try:
        assert (logits(rt, ids, [ad.slot]) - logits(rt, ids, [-1])).abs().max() > 1e-3
    finally:
        for n, lw in saved.items():
            rt.pool.layers[n].adapters[ad.slot] = lw
    base = reference.base_model.model
    with torch.no_grad():
        plain = base(input_ids=ids).logits
        sinks = [layer.self_attn.sinks for layer in base.model.layers]
        kept = [s.clone() for s in sinks]
        for s in sinks:
            s.fill_(-1e4)
        assert (base(input_ids=ids).logits - plain).abs().max() > 1e-2
        for s, k in zip(sinks, kept):
            s.copy_(k)
        base.config.sliding_window = 64
        assert (base(input_ids=ids).logits[:, 8:] - plain[:, 8:]).abs().max() > 1e-3
        base.config.sliding_window = 8

    # One row past the window, one padded.
    result = assert_forward_backward_matches(engine, reference, ad, (17, 6), vocab=VOCAB)
    # Router metrics, as for Qwen3-MoE (their definitions are pinned in test_moe_parity.py).
    assert 0 < result.metrics["e_frac_with_tokens:mean"] <= 1 and "e_max_violation:max" in result.metrics


def test_two_tenants_in_one_batch_equal_each_alone(engine):
    """To 1e-6 relative, as Qwen3-MoE: an expert's tokens are split by slot, so its GEMMs run with
    other row counts than alone."""
    rt = engine.runtime(GPT_OSS)
    first = adapter(engine, "full", FULL, seed=1)
    second = adapter(engine, "second", SECOND, seed=3, scale=0.2)
    ids = torch.randint(0, VOCAB, (3, 12), generator=torch.Generator().manual_seed(4))
    mixed = logits(rt, ids, [first.slot, second.slot, -1])
    for row, slot in enumerate([first.slot, second.slot, -1]):
        alone = logits(rt, ids[row:row + 1], [slot])[0]
        torch.testing.assert_close(mixed[row], alone, rtol=1e-6, atol=1e-5)
    assert (logits(rt, ids[:1], [first.slot]) - logits(rt, ids[:1], [second.slot])).abs().max() > 1e-2


def test_greedy_decode_past_the_window_equals_hf_generate_and_compute_logprobs(engine, model_dir, monkeypatch):
    """Three requests in one decode batch (two adapters and the base; prompts of 5, 11 and 3 tokens,
    a 4-token prefill budget so the long prompt is prefilled over three steps and rows join at
    different steps), 12 tokens each: every row decodes past the 8-token window. Tokens equal HF
    `generate` on the merged adapter, logprobs to 1e-4, and they equal the trainer's forward of
    prompt + tokens (what compute_logprobs returns)."""
    rt = engine.runtime(GPT_OSS)
    ads = [adapter(engine, "full", FULL, seed=1), adapter(engine, "second", SECOND, seed=3, scale=0.2), None]
    prompts = [[9707, 11, 1879, 0, 220], [785, 6722, 315, 9625, 374, 12095, 13, 576, 3974, 13876, 9], [40, 1079, 264]]
    monkeypatch.setattr(sample_mod, "acquire_adapter",
                        lambda runtime, path, max_idle: None if path is None else runtime.pool.acquire(path))
    config = engine.sampler_config.__class__(**{**engine.sampler_config.__dict__, "prefill_tokens_per_step": 4})
    sampler = Sampler(rt, config)
    # The budget counts the sliding layer's columns too: both layers keep every position.
    assert sampler.kv_token_bytes == 2 * 2 * 2 * 16 * 4  # layers x (K, V) x KV heads x head dim x fp32
    params = SamplingParams(max_tokens=12, temperature=0.0, stop_at_eos=False)
    for i, (ad, prompt) in enumerate(zip(ads, prompts)):
        sampler.admit(i, SampleOp(base_model=GPT_OSS, adapter_path=ad.key if ad else None, prompt=np.array(prompt),
                                  params=params))
    done = {}
    while len(done) < 3:
        done.update(dict(sampler.step()))
    for i, (ad, prompt) in enumerate(zip(ads, prompts)):
        (seq,) = done[i].sequences
        if ad is None:
            from transformers import AutoModelForCausalLM

            base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
            ids = torch.tensor([prompt])
            out = base.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False,
                                output_logits=True, return_dict_in_generate=True, eos_token_id=None, pad_token_id=151643)
            want_tokens = out.sequences[0, len(prompt):].tolist()
            want_lps = [torch.log_softmax(s[0].float(), -1)[t].item() for s, t in zip(out.logits, want_tokens)]
        else:
            want_tokens, want_lps = merged_generate(model_dir, ad, prompt, 12)
        assert seq.tokens == want_tokens, i
        np.testing.assert_allclose(seq.logprobs, want_lps, atol=1e-4)
        # Sampled logprobs == the trainer's forward of prompt + tokens (compute_logprobs' path).
        full = np.array(prompt + seq.tokens)
        key = ad.key if ad else None
        if key is not None:
            fwd = run(engine, ForwardBackwardOp(key, [Datum(tokens=full[:-1], loss_fn_inputs={"target_tokens": full[1:]})],
                                                "cross_entropy", forward_only=True))
            np.testing.assert_allclose(fwd.loss_fn_outputs[0]["logprobs"][len(prompt) - 1:], seq.logprobs, atol=1e-4)


def test_bf16_engine_trains_the_experts_with_fp32_master_lora(engine, models_dir):
    """`--dtype bfloat16` on a MoE: the experts' LoRA branch runs in bf16 from the fp32 masters (as
    lora_delta_add does for Linears); before, the fp32 A/B met bf16 activations and the op failed.
    Pinned against the fp32 engine with the same adapter: logprobs within 0.15 nats (bf16's error on
    this model, docs/precision.md), and every expert gradient fp32 and pointing the same way (cosine
    > 0.99)."""
    from tinkerd.engine.precision import Precision

    fp32 = adapter(engine, "full", FULL, seed=1)
    bf16_engine = Engine(models_dir, precision=Precision("cpu", "bfloat16"))
    bf16_engine.load_base_model(GPT_OSS)
    bf16 = random_adapter(bf16_engine, "full", FULL, seed=1, base=GPT_OSS)
    with torch.no_grad():
        for name, (a, b) in bf16.weights.items():
            a.copy_(fp32.weights[name][0])
            b.copy_(fp32.weights[name][1])
    rng = np.random.default_rng(5)
    s = rng.integers(0, VOCAB, 15)
    data = [Datum(tokens=s[:-1], loss_fn_inputs={"target_tokens": s[1:]})]
    results = [run(e, ForwardBackwardOp("full", data, "cross_entropy")) for e in (engine, bf16_engine)]
    np.testing.assert_allclose(results[1].loss_fn_outputs[0]["logprobs"], results[0].loss_fn_outputs[0]["logprobs"],
                               atol=0.15)
    for name in (n for n in fp32.weights if ".experts." in n):
        for want, got in zip(fp32.weights[name], bf16.weights[name]):
            assert got.grad.dtype == torch.float32
            cos = torch.nn.functional.cosine_similarity(got.grad.flatten(), want.grad.flatten(), dim=0)
            assert cos > 0.99, (name, cos.item())
    for ad in (fp32, bf16):
        for t in ad.parameters():
            t.grad = None
        ad.pending_grads = 0
