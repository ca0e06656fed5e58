"""engine/precision.py: the device check, and the bf16 LoRA sum's promises (docs/precision.md)."""

from __future__ import annotations

import pytest
import torch

from tinkerd.engine.engine import Engine
from tinkerd.engine.precision import Precision, lora_delta_add
from tinkerd.errors import UserError
from tinkerd.types import LoraSpec

TINY = "tinkerd/tiny-qwen3"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_cuda_without_a_device_is_refused_by_name(models_dir):
    with pytest.raises(UserError, match="no CUDA device"):
        Engine(models_dir, precision=Precision("cuda", "float32")).load_base_models([TINY])


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
