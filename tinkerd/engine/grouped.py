"""The per-run pieces of a shared training pass (engine/cotrain.py): the layers whose numbers for a
row depend on the other rows of their batch run once per run there, each on its own rows at its own
width, as its op alone runs them.

- attention (`grouped_attention`): SDPA's CPU kernel blocks its softmax sums by the key length, so
  the same row padded to another width comes out different in the last bits (measured: 9, 13 and
  21 tokens padded to 40 all differed); gpt-oss's eager attention with sinks likewise (its softmax
  over a row of keys). Consecutive runs of one width share a call (`attention_calls`).
- linear attention (`grouped_linear_attention`, Qwen3.5's Gated DeltaNet): a causal conv and a
  chunked scan along each row, laid out from the row's width.

Each is installed on a model once (`install`), and outside a shared pass is the layer's own forward.
"""

from __future__ import annotations

import functools
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import torch

from tinkerd.engine import causal
from tinkerd.engine.lora.layers import SlotGroup

if TYPE_CHECKING:
    from tinkerd.engine.engine import ModelRuntime


# The attention implementation a model gets once it runs a shared pass (grouped_attention), by the
# one it had: SDPA, or eager (gpt-oss: its sinks need transformers' eager function).
GROUPED = {"sdpa": "tinkerd_grouped_sdpa", causal.IMPLEMENTATION: "tinkerd_grouped_sdpa", "eager": "tinkerd_grouped_eager"}


@dataclass(frozen=True)
class AttentionGroup:
    """One run's rows in a shared pass, for attention: how many (the runs' rows are consecutive
    blocks of the batch, in group order), its own width, and whether any of its datums is shorter
    than that width (then its op alone gets a padding mask)."""

    size: int
    width: int
    padded: bool


def grouped_attention(module, query, key, value, attention_mask, tinkerd_attention_groups=None, **kwargs):
    """HF's SDPA (or the model's eager) attention, run per run in a shared pass (module docstring);
    unchanged otherwise.

    query/key/value [B, heads, T, d], attention_mask None or [B, 1, T, T] (HF's sdpa_mask or
    eager_mask); returns [B, T, heads, d] as HF's functions do. A run's rows past its width get
    zeros: they are padding, and every position that reads them masks them out. The runs' blocks
    are views (one split each of q, k and v) and their outputs one cat: a gather and an out-of-place
    index_copy per run made a copy of the whole batch's tensors per run, forward and backward."""
    eager = module.config._attn_implementation == GROUPED["eager"]
    if eager:  # the model's own (gpt-oss: with its sinks); an eager op alone always has its mask
        inner = sys.modules[type(module).__module__].eager_attention_forward
    else:  # HF's SDPA, in causal query blocks where the pass asks for them (engine/causal.py)
        inner = causal.sdpa_attention

    if not tinkerd_attention_groups:
        return inner(module, query, key, value, attention_mask, **kwargs)
    t = query.shape[2]
    outs, start = [], 0
    for size, w, unmasked in attention_calls(tinkerd_attention_groups, attention_mask, kwargs.get("sliding_window"),
                                              always_masked=eager):
        q, k, v = (x[start : start + size, :, :w] for x in (query, key, value))
        mask = None if unmasked else attention_mask[start : start + size, :, :w, :w]
        o, _ = inner(module, q, k, v, mask, **kwargs)  # [B_k, w, heads, d]
        outs.append(causal.widen(o, t))
        start += size
    return (outs[0] if len(outs) == 1 else torch.cat(outs)), None


def attention_calls(groups: Sequence[AttentionGroup], attention_mask, window,
                     always_masked: bool = False) -> list[tuple[int, int, bool]]:
    """(rows, width, unmasked) of each SDPA call: one per run, but consecutive runs of one width and
    the same need of a mask share one. Each row of a call is its own batch entry for the kernel,
    blocked by the width alone, so sharing moves no bit (test_cotrain); it spares a call and its
    pad per run and layer, forward and backward (on a GPU, their kernel launches).

    The op alone gets no mask when none of its datums is padded and no window bites (HF's sdpa_mask
    skips it for is_causal), so neither here: the same call takes the same kernel. The causal and
    the masked kernel agreed to the bit on this CPU build (T 6-257, head_dim 16 and 64, 1 thread);
    nothing promises that of other builds or devices."""
    calls: list[tuple[int, int, bool]] = []
    for g in groups:
        unmasked = attention_mask is None or (not always_masked and not g.padded and (window is None or g.width < window))
        if calls and calls[-1][1:] == (g.width, unmasked):
            calls[-1] = (calls[-1][0] + g.size, g.width, unmasked)
        else:
            calls.append((g.size, g.width, unmasked))
    return calls


def grouped_linear_attention(module, ctx, hidden_states, cache=None, attention_mask=None,
                             tinkerd_attention_groups=None, **kwargs):
    """A linear-attention layer (Qwen3.5's Gated DeltaNet), run per run in a shared pass; its own
    forward otherwise. Its causal conv and chunked delta rule run along the positions of a row, in
    chunks laid out from the row's width, so a run's rows padded wider would round differently:
    each run gets the layer alone, on its rows at its own width, with its LoRA alone (ctx single)
    and the padding mask its op alone gets (transformers' create_recurrent_attention_mask: none for
    a batch without padding). What this leaves shared on a hybrid model: the MLPs, the
    full-attention layers' projections, the norms, the head."""
    forward = type(module).forward
    if not tinkerd_attention_groups:
        return forward(module, hidden_states, cache=cache, attention_mask=attention_mask, **kwargs)
    t = hidden_states.shape[1]
    groups, blocks = ctx.groups, ctx.blocks
    outs, start = [], 0
    try:
        for g, slot_group in zip(tinkerd_attention_groups, groups):
            w = g.width
            mask = None if attention_mask is None else attention_mask[start : start + g.size, :w]
            if mask is not None and (w == 1 or bool(torch.all(mask == 1))):
                mask = None
            ctx.groups, ctx.blocks = [SlotGroup(slot_group.slot, None)], False
            o = forward(module, hidden_states[start : start + g.size, :w], cache=cache, attention_mask=mask, **kwargs)
            outs.append(causal.widen(o, t))
            start += g.size
    finally:
        ctx.groups, ctx.blocks = groups, blocks
    return torch.cat(outs)


def install(rt: "ModelRuntime") -> None:
    """Switch the model to grouped_attention, which equals HF's SDPA (or its eager function) outside
    shared passes, and its linear-attention layers to grouped_linear_attention; once. Each is a
    registered implementation name or an instance attribute: the module tree, and so every
    parameter's name, is unchanged."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask, sdpa_mask

    own = rt.model.config._attn_implementation
    if own in GROUPED.values():
        return
    if own not in GROUPED:
        raise RuntimeError(f"shared passes need SDPA or eager attention, the model uses {own!r}")
    for module in rt.model.modules():
        if type(module).__name__.endswith("GatedDeltaNet"):
            module.forward = functools.partial(grouped_linear_attention, module, rt.ctx)
    AttentionInterface.register(GROUPED[own], grouped_attention)
    AttentionMaskInterface.register(GROUPED[own], eager_mask if own == "eager" else sdpa_mask)
    rt.model.set_attn_implementation(GROUPED[own])
