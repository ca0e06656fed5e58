"""The multi-slot LoRA layer: one base Linear, many adapters, a per-row slot mapping.

Every adapter lives in a slot (an int). Before a forward pass the engine sets `LoraContext.groups`:
which rows of the batch use which slot. Each wrapped Linear then adds, for each group,
    scaling_s * (x[rows] @ A_s^T) @ B_s^T
to the base output. Adapters of different ranks coexist because each slot keeps its own A [R, in]
and B [out, R]. Rows whose slot has no adapter on this layer (or slot -1) get the base model.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

# HF module names of the layers tinkerd can adapt, grouped as the SDK's LoraConfig flags name them.
ATTN_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_TARGETS = ("gate_proj", "up_proj", "down_proj")
UNEMBED_TARGET = "lm_head"


@dataclass
class SlotGroup:
    slot: int
    # Row indices into the batch; None means every row (the common single-adapter case, no gather).
    rows: torch.Tensor | None


@dataclass
class LoraContext:
    """Per-forward routing shared by every MultiLoraLinear of one base model."""

    groups: list[SlotGroup] = field(default_factory=list)

    def set_single(self, slot: int) -> None:
        self.groups = [SlotGroup(slot, None)]

    def set_rows(self, row_slots: list[int]) -> None:
        """Route row i of the next batch to adapter slot row_slots[i] (-1 = base model)."""
        if len(set(row_slots)) == 1:
            self.set_single(row_slots[0])
            return
        by_slot: dict[int, list[int]] = {}
        for i, s in enumerate(row_slots):
            by_slot.setdefault(s, []).append(i)
        self.groups = [SlotGroup(s, torch.tensor(rows, dtype=torch.long)) for s, rows in by_slot.items()]

    def clear(self) -> None:
        self.groups = []


@dataclass
class LoraWeights:
    a: torch.Tensor  # [R, in]
    b: torch.Tensor  # [out, R]
    scaling: float


class MultiLoraLinear(nn.Module):
    def __init__(self, base: nn.Linear, ctx: LoraContext):
        super().__init__()
        self.base = base
        self.ctx = ctx
        # Not registered as parameters: adapters belong to the pool, not to the base model's
        # state_dict, and come and go at run time.
        self.adapters: dict[int, LoraWeights] = {}

    @property
    def in_features(self) -> int:
        return self.base.in_features

    @property
    def out_features(self) -> int:
        return self.base.out_features

    @property
    def weight(self) -> torch.Tensor:
        return self.base.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.base(x)
        for group in self.ctx.groups:
            lw = self.adapters.get(group.slot)
            if lw is None:
                continue
            if group.rows is None:
                out = out + ((x @ lw.a.t()) @ lw.b.t()) * lw.scaling
            else:
                delta = ((x[group.rows] @ lw.a.t()) @ lw.b.t()) * lw.scaling
                out = out.index_add(0, group.rows, delta)
        return out


def wrap_model(model: nn.Module, ctx: LoraContext, targets: tuple[str, ...]) -> dict[str, MultiLoraLinear]:
    """Replace every nn.Linear whose attribute name is in `targets` by a MultiLoraLinear.

    Returns the wrapped layers by their full module name (HF naming, e.g.
    `model.layers.0.self_attn.q_proj`, `lm_head`), the key adapters use for their weights.
    """
    wrapped: dict[str, MultiLoraLinear] = {}
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            if child_name in targets and isinstance(child, nn.Linear):
                layer = MultiLoraLinear(child, ctx)
                setattr(module, child_name, layer)
                full = f"{name}.{child_name}" if name else child_name
                wrapped[full] = layer
    return wrapped


def targets_for(spec_attn: bool, spec_mlp: bool, spec_unembed: bool) -> tuple[str, ...]:
    return (ATTN_TARGETS if spec_attn else ()) + (MLP_TARGETS if spec_mlp else ()) + (
        (UNEMBED_TARGET,) if spec_unembed else ()
    )
