"""File layout of LoRA on Qwen3.5's fused Gated DeltaNet input projection (`in_proj_qkv`).

transformers' `Qwen3_5GatedDeltaNet` computes q, k and v with one Linear, `in_proj_qkv`, whose
output rows are q (key_dim) | k (key_dim) | v (value_dim); tinkerd trains one LoRA on it,
A [R, H] and B [2 key_dim + value_dim, R]. Hosted Tinker trains and exports the three as
`linear_attn.in_proj_q`, `in_proj_k`, `in_proj_v`, and the cookbook's `weights` module expects
that: `build_hf_model` re-fuses them into `in_proj_qkv` at row offsets taken from the lora_B
shapes and needs all three (tinker_cookbook/weights/_merge_qwen3_5.py), `build_lora_adapter` keeps
them split. So checkpoints and exports hold tinkerd's LoRA as three LoRAs sharing A, with B cut at
the q|k|v boundaries: B_q @ A, B_k @ A and B_v @ A are exactly the three row blocks of B @ A.

Reading re-fuses them (B stacked in q, k, v order); three different A's (an adapter trained
elsewhere on split projections) cannot be one LoRA on the fused Linear and are refused.
"""

from __future__ import annotations

import torch
from torch import nn

FUSED = "in_proj_qkv"
PARTS = ("in_proj_q", "in_proj_k", "in_proj_v")


def qkv_split(parent: nn.Module, child_name: str) -> tuple[int, int, int] | None:
    """The q|k|v row counts of `parent.<child_name>` when it is a DeltaNet's fused in_proj_qkv."""
    if child_name != FUSED or not hasattr(parent, "key_dim") or not hasattr(parent, "value_dim"):
        return None
    return (int(parent.key_dim), int(parent.key_dim), int(parent.value_dim))


def file_names(name: str) -> list[str]:
    """The layer names one adapter layer is stored under (three for a fused in_proj_qkv)."""
    parent, _, leaf = name.rpartition(".")
    return [f"{parent}.{p}" for p in PARTS] if leaf == FUSED else [name]


def to_file_layout(name: str, a: torch.Tensor, b: torch.Tensor,
                   split: tuple[int, ...] | None) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """(file layer name, A, B) for one adapter layer; anything but a split in_proj_qkv passes through."""
    if split is None or name.rpartition(".")[2] != FUSED:
        return [(name, a, b)]
    if sum(split) != b.shape[0]:
        raise ValueError(f"{name}: lora_B has {b.shape[0]} rows, not q|k|v = {split}")
    return [(n, a, part) for n, part in zip(file_names(name), b.split(list(split), dim=0))]


def from_file_layout(weights: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Inverse of to_file_layout over a whole adapter; ValueError for parts it cannot fuse."""
    out: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for name, (a, b) in weights.items():
        parent, _, leaf = name.rpartition(".")
        if leaf not in PARTS:
            out[name] = (a, b)
            continue
        if leaf != PARTS[0]:
            if f"{parent}.{PARTS[0]}" not in weights:
                raise ValueError(f"{name} has no {PARTS[0]} beside it")
            continue
        parts = [weights.get(f"{parent}.{p}") for p in PARTS]
        if any(p is None for p in parts):
            raise ValueError(f"{parent}: in_proj_q/k/v must all be present to fuse into {FUSED}")
        if any(p[0].shape != a.shape or not torch.equal(p[0], a) for p in parts):
            raise ValueError(f"{parent}: in_proj_q/k/v have different lora_A; tinkerd trains one LoRA on the fused {FUSED}")
        out[f"{parent}.{FUSED}"] = (a, torch.cat([p[1] for p in parts], dim=0))
    return out
