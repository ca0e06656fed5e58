"""tinkerd's multi-LoRA forward and gradients equal Hugging Face + PEFT with the same A/B.

PEFT is the reference (house style §9): if the wrapped layers, the scaling, the padding/packing of
forward_backward or the log-prob computation drift, these numbers move. tinkerd runs in fp32; the
PEFT reference runs the same model in fp64, because PEFT's own fp32 rounding (log_softmax over 151k
logits, then two layers of backward) is ~3e-6 of the largest gradient, three times tinkerd's, and
an fp32-vs-fp32 check at 1e-5 would mostly measure PEFT's noise.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

from tinkerd.engine import buckets, causal
from tinkerd.types import CreateModelOp, Datum, ForwardBackwardOp, ForwardBackwardResult, LoraSpec

BASE = "tinkerd/tiny-qwen3"
TOL = dict(rtol=1e-5, atol=1e-5)


def assert_close_scaled(ours: torch.Tensor, reference: torch.Tensor, what: str) -> None:
    """|ours − reference| ≤ 1e-5 · max(1, max|reference|): the fp32 tolerance, scaled to the tensor
    (logits reach ~30 and gradients ~35 here; an unscaled 1e-5 would ask for fewer than 3 ulps)."""
    scale = max(1.0, reference.abs().max().item())
    err = (ours.double() - reference).abs().max().item()
    assert err <= 1e-5 * scale, f"{what}: max error {err:.3e} > 1e-5 x {scale:.2f}"

SPECS = {
    # Every target including the unembedding, the SDK's default shape.
    "full": LoraSpec(rank=8, alpha=32.0, seed=11),
    # A different rank, scaling and target set in the same engine.
    "attn_unembed": LoraSpec(rank=4, alpha=8.0, seed=12, train_mlp=False),
}


def run(engine, op):
    (result,) = engine.run_ops([op])
    if isinstance(result, Exception):
        raise result
    return result


def randomized_adapter(engine, model_id: str, spec: LoraSpec, seed: int):
    """An adapter whose B is non-zero, so the LoRA path really contributes to logits and grads."""
    rt = engine.runtime(BASE)
    if model_id not in rt.pool:
        run(engine, CreateModelOp(model_id, BASE, spec))
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for _, b in rt.pool.get(model_id).weights.values():
                b.copy_(torch.randn(b.shape, generator=gen) * 0.05)
    return rt.pool.get(model_id)


def peft_reference(model_dir, adapter):
    """HF + PEFT in fp64 with the adapter's A/B copied in."""
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64).eval()
    config = LoraConfig(
        r=adapter.spec.rank,
        lora_alpha=adapter.spec.alpha,
        target_modules=sorted({n.rsplit(".", 1)[-1] for n in adapter.weights}),
        lora_dropout=0.0,
    )
    model = get_peft_model(base, config).eval()
    inner = model.base_model.model
    with torch.no_grad():
        for name, (a, b) in adapter.weights.items():
            module = inner.get_submodule(name)
            module.lora_A["default"].weight.copy_(a.double())
            module.lora_B["default"].weight.copy_(b.double())
    # Same set of adapted layers on both sides, or the comparison would be vacuous.
    adapted = {n for n, m in inner.named_modules() if hasattr(m, "lora_A") and "default" in m.lora_A}
    assert adapted == set(adapter.weights)
    return model


def tinkerd_logits(rt, input_ids, slot: int | None) -> torch.Tensor:
    if slot is None:
        rt.ctx.clear()
    else:
        rt.ctx.set_single(slot)
    try:
        with torch.no_grad():
            return rt.model(input_ids=input_ids).logits
    finally:
        rt.ctx.clear()


@pytest.fixture(scope="module")
def token_batch() -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    return torch.randint(0, 151_000, (3, 12), generator=gen)  # [B, T]


@pytest.mark.parametrize("which", sorted(SPECS))
def test_logits_and_grads_equal_peft(engine, tiny_model_dir, token_batch, which, monkeypatch):
    rt = engine.runtime(BASE)
    adapter = randomized_adapter(engine, f"parity-{which}", SPECS[which], seed=100)
    reference = peft_reference(tiny_model_dir, adapter)

    ours = tinkerd_logits(rt, token_batch, adapter.slot)
    with torch.no_grad():
        theirs = reference(input_ids=token_batch).logits
    assert_close_scaled(ours, theirs, "logits")
    # And the adapter really moves the logits (B was randomised), so the check above is not vacuous.
    assert (ours - tinkerd_logits(rt, token_batch, None)).abs().max() > 1e-2

    # Two datums of different lengths with any-sign weights through the engine: as one padded batch,
    # and run in length buckets (engine/buckets.py; forced here, as the batch is small). From 64
    # tokens the attention runs in causal query blocks (engine/causal.py), with the padding mask and
    # without one.
    blocked = []
    apply = causal.CausalBlocks.apply
    monkeypatch.setattr(causal.CausalBlocks, "apply", lambda q, *a: blocked.append(q.shape[2]) or apply(q, *a))
    for lengths, min_padding in (((9, 5), buckets.MIN_PADDING), ((12, 3), 0), ((100, 70), buckets.MIN_PADDING),
                                 ((80, 80), buckets.MIN_PADDING)):
        monkeypatch.setattr(buckets, "MIN_PADDING", min_padding)
        assert (buckets.plan(list(lengths)) is not None) == (min_padding == 0)
        reference.zero_grad(set_to_none=True)
        rng = np.random.default_rng(1)
        seqs = [rng.integers(0, 151_000, n + 1) for n in lengths]
        weights = [rng.normal(size=n).astype(np.float32) for n in lengths]
        data = [Datum(tokens=s[:-1], loss_fn_inputs={"target_tokens": s[1:], "weights": w}) for s, w in zip(seqs, weights)]
        for t in adapter.parameters():
            t.grad = None
        result = run(engine, ForwardBackwardOp(adapter.key, data, "cross_entropy"))
        assert isinstance(result, ForwardBackwardResult)

        total, magnitude = torch.zeros((), dtype=torch.float64), 0.0
        for i, (s, w) in enumerate(zip(seqs, weights)):
            logits = reference(input_ids=torch.from_numpy(s[:-1])[None]).logits[0]  # [N, V]
            lp = torch.log_softmax(logits, -1).gather(-1, torch.from_numpy(s[1:])[:, None])[:, 0]
            np.testing.assert_allclose(result.loss_fn_outputs[i]["logprobs"], lp.detach().numpy(), **TOL)
            total = total - (lp * torch.from_numpy(w).double()).sum()
            magnitude += (lp * torch.from_numpy(w).double()).abs().sum().item()
        total.backward()
        # Any-sign weights can cancel the sum down to a small total: fp32's tolerance is the terms'.
        assert result.metrics["loss:sum"] == pytest.approx(total.item(), abs=1e-5 * magnitude)

        inner = reference.base_model.model
        for name, (a, b) in adapter.weights.items():
            module = inner.get_submodule(name)
            assert_close_scaled(a.grad, module.lora_A["default"].weight.grad, f"lora_A grad of {name}")
            assert_close_scaled(b.grad, module.lora_B["default"].weight.grad, f"lora_B grad of {name}")
    assert all(a.grad.abs().max() > 0 for a, _ in adapter.weights.values())
    assert set(blocked) == {100, 80}


def test_rows_routed_to_two_adapters_equal_each_alone(engine, token_batch):
    rt = engine.runtime(BASE)
    first = randomized_adapter(engine, "parity-full", SPECS["full"], seed=100)
    second = randomized_adapter(engine, "parity-attn_unembed", SPECS["attn_unembed"], seed=100)

    rt.ctx.set_rows([first.slot, second.slot, -1])  # row 2: the base model
    try:
        with torch.no_grad():
            mixed = rt.model(input_ids=token_batch).logits  # [3, T, V]
    finally:
        rt.ctx.clear()

    alone = [
        tinkerd_logits(rt, token_batch[0:1], first.slot)[0],
        tinkerd_logits(rt, token_batch[1:2], second.slot)[0],
        tinkerd_logits(rt, token_batch[2:3], None)[0],
    ]
    for row, expected in enumerate(alone):
        torch.testing.assert_close(mixed[row], expected, **TOL)
    # The two adapters differ on the same input, so a routing mix-up could not pass unnoticed.
    one_row = token_batch[:1]
    assert (tinkerd_logits(rt, one_row, first.slot) - tinkerd_logits(rt, one_row, second.slot)).abs().max() > 1e-2


def test_fresh_adapter_equals_base_model_exactly(engine, token_batch):
    rt = engine.runtime(BASE)
    run(engine, CreateModelOp("parity-fresh", BASE, LoraSpec(rank=8, alpha=32.0, seed=3)))
    fresh = rt.pool.get("parity-fresh")
    assert torch.equal(tinkerd_logits(rt, token_batch, fresh.slot), tinkerd_logits(rt, token_batch, None))
