"""benchmarks/step_floor.py times the GEMMs a LoRA step cannot skip; benchmarks/training.py judges
every side's step against it. Its GEMMs must be the step's: the useful work F of training.py's
formula, less only what no implementation computes (layer 0's q/k/v input gradients, whose input is
the frozen embedding), counted by torch's own FLOP counter on a small Llama shape."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode
from transformers import LlamaConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from step_floor import Floor, linears  # noqa: E402
from training import step_flops  # noqa: E402


def _addmm_flops(c_shape, a_shape, b_shape, out_shape=None, **kwargs) -> int:
    return 2 * a_shape[0] * a_shape[1] * b_shape[1]


def _linear_flops(x_shape, w_shape, *args, **kwargs) -> int:
    """oneDNN's linear (engine/gemm.py): x [..., in] W^T, W [out, in]."""
    rows = 1
    for n in x_shape[:-1]:
        rows *= n
    return 2 * rows * w_shape[0] * w_shape[1]


MAPPING = {torch.ops.aten.addmm_: _addmm_flops, torch.ops.mkldnn._linear_pointwise: _linear_flops}


@pytest.mark.parametrize("unembed", [False, True])
@pytest.mark.parametrize("tokens", [16, 32])  # 64 rows: the head LoRA's products on oneDNN (head.LORA_MIN_ROWS)
def test_floor_runs_the_steps_gemms(unembed, tokens):
    config = LlamaConfig(hidden_size=64, intermediate_size=160, num_hidden_layers=3, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=20_000)  # ten vocabulary tiles (engine/head.py)
    rows, rank = 2, 4
    floor = Floor(config, rows, tokens, rank, unembed)
    counted = {}
    for name in ("body", "head"):
        # The counter knows addmm but not its in-place form, nor oneDNN's linear (engine/gemm.py).
        with FlopCounterMode(display=False, custom_mapping=MAPPING) as counter:
            getattr(floor, name)()
        counted[name] = counter.get_total_flops()
    n = rows * tokens
    head_dim = config.hidden_size // config.num_attention_heads
    attention = 3 * config.num_hidden_layers * 4 * rows * tokens**2 * config.num_attention_heads * head_dim
    skipped = sum(2 * n * i * o + 2 * n * rank * i for i, o in linears(config)[:3])
    assert counted["body"] + counted["head"] == (
        step_flops(config, rank, rows, tokens, unembed) - attention - skipped)


def test_floor_parts_are_timed():
    config = LlamaConfig(hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=3000)
    parts = Floor(config, 2, 64, 4).parts(repeats=1)
    assert set(parts) == {"body", "head", "attention", "adamw", "floor"}
    assert all(v > 0 for v in parts.values())
    assert parts["floor"] == pytest.approx(parts["body"] + parts["head"] + parts["attention"] + parts["adamw"])
