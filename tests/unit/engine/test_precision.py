"""engine/precision.py: the device check, and the bf16 LoRA sum's promises (docs/precision.md)."""

from __future__ import annotations

import pytest
import torch

from tinkerd.engine.engine import Engine
from tinkerd.engine.precision import Precision, lora_delta, lora_delta_add
from tinkerd.errors import UserError
from tinkerd.types import LoraSpec

TINY = "tinkerd/tiny-qwen3"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_cuda_without_a_device_is_refused_by_name(models_dir):
    with pytest.raises(UserError, match="no CUDA device"):
        Engine(models_dir, precision=Precision("cuda", "float32")).load_base_models([TINY])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rank, alpha", [(32, 32.0), (8, 32.0), (64, 32.0), (128, 16.0), (24, 32.0), (16, 7.0)])
def test_lora_delta_has_pefts_bits_forward_and_backward(rank, alpha, dtype):
    """A power-of-two scaling moves onto the rank-r product (or goes, when 1): the delta and the
    gradients of x, A and B are PEFT's `lora_B(lora_A(x)) * scaling` to the bit, for every scaling."""
    g = torch.Generator().manual_seed(rank)
    x0, a0, b0 = (torch.randn(*shape, generator=g) for shape in ((2, 37, 96), (rank, 96), (80, rank)))
    grad = torch.randn(2, 37, 80, generator=g).to(dtype)

    def run(fn):
        x, a, b = (t.to(dtype).requires_grad_(True) for t in (x0, a0, b0))
        y = fn(x, a, b)
        y.backward(grad)
        return [y.detach(), x.grad, a.grad, b.grad]

    ours = run(lambda x, a, b: lora_delta(x, a, b, alpha / rank))
    peft = run(lambda x, a, b: torch.nn.functional.linear(torch.nn.functional.linear(x, a), b) * (alpha / rank))
    for got, want in zip(ours, peft):
        assert torch.equal(got, want)


def test_lora_sum_equals_peft_under_autocast():
    from peft import LoraConfig, get_peft_model

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, 16, generator=gen).bfloat16()
    a, b = torch.randn(4, 16, generator=gen), torch.randn(8, 4, generator=gen) * 1e-2
    base = torch.nn.Sequential()
    base.add_module("proj", torch.nn.Linear(16, 8, bias=False))
    base = base.bfloat16()
    peft = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["proj"], lora_dropout=0.0))
    layer = peft.base_model.model.proj
    with torch.no_grad():
        layer.lora_A["default"].weight.copy_(a)
        layer.lora_B["default"].weight.copy_(b)
    assert layer.lora_A["default"].weight.dtype == torch.float32  # PEFT's fp32 masters on a bf16 model
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        want = layer(x)
    got = lora_delta_add(layer.base_layer(x), x, a, b, 2.0)
    assert got.dtype == want.dtype == torch.bfloat16
    assert torch.equal(got, want)


def test_bf16_rows_routed_to_two_adapters_equal_each_alone(models_dir):
    engine = Engine(models_dir, precision=Precision("cpu", "bfloat16"))
    rt = engine.load_base_model(TINY)
    first = rt.pool.create("prec-1", LoraSpec(rank=4, alpha=8.0, seed=1), trainable=False)
    second = rt.pool.create("prec-2", LoraSpec(rank=8, alpha=32.0, seed=2), trainable=False)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for adapter in (first, second):
            for _, b in adapter.weights.values():
                b.copy_(torch.randn(b.shape, generator=gen) * 0.05)
    tokens = torch.randint(0, 151_000, (3, 10), generator=gen)

    def logits(rows: list[int], ids: torch.Tensor) -> torch.Tensor:
        rt.ctx.set_rows(rows)
        try:
            with torch.no_grad():
                return rt.model(input_ids=ids).logits
        finally:
            rt.ctx.clear()

    mixed = logits([first.slot, second.slot, -1], tokens)
    assert mixed.dtype == torch.bfloat16
    for row, slot in enumerate((first.slot, second.slot, -1)):
        assert torch.equal(mixed[row], logits([slot], tokens[row:row + 1])[0])
    assert not torch.equal(mixed[0], logits([-1], tokens[0:1])[0])  # the adapter really moved row 0
