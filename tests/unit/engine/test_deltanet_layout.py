"""Qwen3.5's fused in_proj_qkv LoRA is stored as hosted Tinker's split in_proj_q/k/v (lora/deltanet.py)."""

from __future__ import annotations

import pytest
import torch

from tinkerd.engine.lora import deltanet

NAME = "model.layers.0.linear_attn.in_proj_qkv"


def test_split_products_are_the_fused_row_blocks_and_reading_fuses_them_back():
    a, b = torch.randn(4, 64), torch.randn(96, 4)
    parts = deltanet.to_file_layout(NAME, a, b, (16, 16, 64))
    assert [(n.rsplit(".", 1)[1], tuple(pb.shape)) for n, _, pb in parts] == [
        ("in_proj_q", (16, 4)), ("in_proj_k", (16, 4)), ("in_proj_v", (64, 4))]
    assert torch.equal(torch.cat([pb @ pa for _, pa, pb in parts]), b @ a)
    back = deltanet.from_file_layout({n: (pa, pb) for n, pa, pb in parts} | {"lm_head": (a, b)})
    assert set(back) == {NAME, "lm_head"} and torch.equal(back[NAME][1], b) and torch.equal(back[NAME][0], a)
    assert deltanet.to_file_layout("model.layers.3.self_attn.q_proj", a, b, None) == [("model.layers.3.self_attn.q_proj", a, b)]


def test_parts_that_cannot_be_one_lora_are_refused():
    a, b = torch.randn(4, 64), torch.randn(96, 4)
    parts = {n: (pa, pb) for n, pa, pb in deltanet.to_file_layout(NAME, a, b, (16, 16, 64))}
    k = NAME.replace("qkv", "k")
    with pytest.raises(ValueError, match="different lora_A"):
        deltanet.from_file_layout(parts | {k: (torch.randn(4, 64), parts[k][1])})
    with pytest.raises(ValueError, match="must all be present"):
        deltanet.from_file_layout({n: p for n, p in parts.items() if n != k})
    with pytest.raises(ValueError, match="rows"):
        deltanet.to_file_layout(NAME, a, b, (16, 16, 32))
