"""What the parity tests of the MoE and hybrid families share: the engine side (a loaded engine, an
op run, a random adapter, logits per adapter slot) and the HF + PEFT oracle (the reference with
tinkerd's A/B copied in, its LoRA grads in tinkerd's layout, greedy generate on the merged adapter).

The oracle targets every module tinkerd's adapter has (`target_modules`) and, on a MoE, the routed
experts' stacked weights (`target_parameters`), whose A/B are converted to PEFT ParamWrapper's
layout. It runs MoE experts through the eager loop: transformers' default on CPU is grouped_mm,
which has no fp64 kernel. gpt-oss's fused gate_up_proj interleaves gate and up columns, so
PEFT's B for it has rows g0, u0, g1, u1, ... where tinkerd keeps gate rows first
(engine/lora/experts.py): `_interleave` / `_deinterleave` convert.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

from tinkerd.engine.engine import Engine
from tinkerd.engine.model.registry import cache_dir_for
from tinkerd.types import CreateModelOp, Datum, ForwardBackwardOp, ForwardBackwardResult, LoraSpec

EXPERT_PARAMS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


def loaded_engine(models_dir, base: str) -> Engine:
    engine = Engine(models_dir)
    engine.load_base_model(base)
    return engine


def family_fixtures(base: str, engine_name: str, dir_name: str):
    """A family's parity module's two fixtures: an engine serving `base` (`engine_name`) and the
    directory its converted checkpoint is in, for PEFT to load (`dir_name`). Assign both to those names."""

    @pytest.fixture(scope="module", name=engine_name)
    def engine(models_dir) -> Engine:
        return loaded_engine(models_dir, base)

    @pytest.fixture(scope="module", name=dir_name)
    def model_dir(request, models_dir):
        request.getfixturevalue(engine_name)  # loading converts the checkpoint into models_dir
        return cache_dir_for(base, models_dir)

    return engine, model_dir


def run(engine, op):
    (result,) = engine.run_ops([op])
    if isinstance(result, Exception):
        raise result
    return result


def random_adapter(engine, key: str, spec: LoraSpec, seed: int, scale: float = 0.05, *, base: str):
    """An adapter of `base` with random non-zero B everywhere, so every LoRA really moves the outputs."""
    rt = engine.runtime(base)
    if key not in rt.pool:
        run(engine, CreateModelOp(key, base, spec))
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for _, b in rt.pool.get(key).weights.values():
                b.copy_(torch.randn(b.shape, generator=gen) * scale)
    return rt.pool.get(key)


def _interleaved(module, pname: str | None) -> bool:
    return pname == "gate_up_proj" and not getattr(module.get_base_layer(), "is_concatenated", True)


def _interleave(b: torch.Tensor) -> torch.Tensor:
    """B [E, 2I, R] gate rows first -> rows g0, u0, g1, u1, ..."""
    e, out, r = b.shape
    return b.view(e, 2, out // 2, r).transpose(1, 2).reshape(e, out, r)


def _deinterleave(b: torch.Tensor) -> torch.Tensor:
    return torch.cat([b[:, 0::2], b[:, 1::2]], dim=1)


def peft_reference(model_dir, ad, dtype=torch.float64, auto=AutoModelForCausalLM):
    """HF + PEFT with the adapter's tensors copied in; expert A/B converted to ParamWrapper's layout.
    `auto`: the transformers auto class the base loads with (AutoModelForImageTextToText for a VLM)."""
    base = auto.from_pretrained(model_dir, dtype=dtype).eval()
    if any(name.endswith(".experts") for name, _ in base.named_modules()):
        base.set_experts_implementation("eager")
    short = {n.rsplit(".", 1)[-1] for n in ad.weights if ".experts." not in n}
    config = LoraConfig(r=ad.spec.rank, lora_alpha=ad.spec.alpha, lora_dropout=0.0, target_modules=sorted(short),
                        target_parameters=EXPERT_PARAMS if any(".experts." in n for n in ad.weights) else None)
    model = get_peft_model(base, config).eval()
    for name, module in model.base_model.model.named_modules():
        if not (hasattr(module, "lora_A") and "default" in module.lora_A):
            continue
        pname = getattr(module, "parameter_name", None)
        a, b = ad.weights[f"{name.removesuffix('.base_layer')}.{pname}" if pname else name]
        with torch.no_grad():
            if pname:  # A [E, R, in] -> [E*R, in]; B [E, out, R] -> [out, R*E], expert the fast axis
                b = _interleave(b) if _interleaved(module, pname) else b
                module.lora_A["default"].weight.copy_(a.reshape(-1, a.shape[-1]).to(dtype))
                module.lora_B["default"].weight.copy_(b.permute(1, 2, 0).reshape(b.shape[1], -1).to(dtype))
            else:
                module.lora_A["default"].weight.copy_(a.to(dtype))
                module.lora_B["default"].weight.copy_(b.to(dtype))
    return model


def peft_lora_tensors(model, ad) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """The reference's LoRA tensors (grads included) under tinkerd's names and layouts."""
    out = {}
    for name, module in model.base_model.model.named_modules():
        if not (hasattr(module, "lora_A") and "default" in module.lora_A):
            continue
        pname = getattr(module, "parameter_name", None)
        a, b = module.lora_A["default"].weight, module.lora_B["default"].weight
        if pname:
            e = module.num_experts
            b_grad = b.grad.reshape(b.shape[0], -1, e).permute(2, 0, 1)
            out[f"{name.removesuffix('.base_layer')}.{pname}"] = (
                a.grad.reshape(e, -1, a.shape[-1]), _deinterleave(b_grad) if _interleaved(module, pname) else b_grad)
        else:
            out[name] = (a.grad, b.grad)
    assert set(out) == set(ad.weights)
    return out


def logits(rt, ids, slots):
    rt.ctx.set_rows(slots) if len(slots) > 1 else rt.ctx.set_single(slots[0])
    try:
        with torch.no_grad():
            return rt.model(input_ids=ids).logits
    finally:
        rt.ctx.clear()


def merged_generate(model_dir, ad, prompt: list[int], n: int):
    """HF generate (greedy) on the base with the adapter merged in (PEFT merge_and_unload, fp32):
    the tokens and their logprobs."""
    merged = peft_reference(model_dir, ad, dtype=torch.float32).merge_and_unload().eval()
    with torch.no_grad():
        ids = torch.tensor([prompt])  # an explicit mask: generate would take token 0 in the prompt for padding
        out = merged.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                              output_logits=True, return_dict_in_generate=True, eos_token_id=None, pad_token_id=151643)
    tokens = out.sequences[0, len(prompt):].tolist()
    lps = [torch.log_softmax(s[0].float(), -1)[t].item() for s, t in zip(out.logits, tokens)]
    return tokens, np.array(lps)


def assert_lora_grads_match(reference, ad) -> None:
    """Every LoRA A/B grad of the tinkerd adapter `ad` equals the PEFT reference's (after its
    backward) within assert_close_scaled, none is all zero; then `ad`'s grads are cleared."""
    from tests.parity.test_lora_parity import assert_close_scaled

    grads = peft_lora_tensors(reference, ad)  # experts' grads in tinkerd's layout too
    for name, (a, b) in ad.weights.items():
        assert_close_scaled(a.grad, grads[name][0], f"lora_A grad of {name}")
        assert_close_scaled(b.grad, grads[name][1], f"lora_B grad of {name}")
        assert a.grad.abs().max() > 0 and b.grad.abs().max() > 0, name
    for t in ad.parameters():
        t.grad = None
    ad.pending_grads = 0


def assert_forward_backward_matches(engine, reference, ad, lengths: tuple[int, ...], vocab: int = 151_000,
                                    seed: int = 1) -> ForwardBackwardResult:
    """A cross_entropy forward_backward of `ad` on random weighted datums of these lengths (a padded
    batch) against the reference run one unpadded row at a time: per-token logprobs (1e-5), the
    loss (1e-5 relative) and every LoRA grad in tinkerd's layouts (peft_lora_tensors,
    assert_close_scaled; none all zero). Clears `ad`'s grads after; returns the op's result."""
    import pytest

    from tests.parity.test_lora_parity import assert_close_scaled

    rng = np.random.default_rng(seed)
    seqs = [rng.integers(0, vocab, n + 1) for n in lengths]
    weights = [rng.normal(size=n).astype(np.float32) for n in lengths]
    data = [Datum(tokens=s[:-1], loss_fn_inputs={"target_tokens": s[1:], "weights": w}) for s, w in zip(seqs, weights)]
    for t in ad.parameters():
        t.grad = None
    result = run(engine, ForwardBackwardOp(ad.key, data, "cross_entropy"))
    assert isinstance(result, ForwardBackwardResult)
    total = torch.zeros((), dtype=torch.float64)
    for i, (s, w) in enumerate(zip(seqs, weights)):
        lp = torch.log_softmax(reference(input_ids=torch.from_numpy(s[:-1])[None]).logits[0], -1)
        lp = lp.gather(-1, torch.from_numpy(s[1:])[:, None])[:, 0]
        np.testing.assert_allclose(result.loss_fn_outputs[i]["logprobs"], lp.detach().numpy(), rtol=1e-5, atol=1e-5)
        total = total - (lp * torch.from_numpy(w).double()).sum()
    total.backward()
    assert result.metrics["loss:sum"] == pytest.approx(total.item(), rel=1e-5)
    want = peft_lora_tensors(reference, ad)
    for name, (a, b) in ad.weights.items():
        assert_close_scaled(a.grad, want[name][0], f"lora_A grad of {name}")
        assert_close_scaled(b.grad, want[name][1], f"lora_B grad of {name}")
        assert a.grad.abs().max() > 0 and b.grad.abs().max() > 0, name
    for t in ad.parameters():
        t.grad = None
    ad.pending_grads = 0
    return result
