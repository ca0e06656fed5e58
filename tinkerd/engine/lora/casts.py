"""A sampling adapter's fp32 master A and B in a bf16 layer's dtype, copied once, not per call.

A bf16 base with fp32 master adapters computes the LoRA branch in bf16 from A and B cast for the
call, as autocast does (engine/precision.py). Cast on every call, that is two copies per adapted
linear: 422 casts of ~30 us for a rank-32 SmolLM2 adapter in every decode step of the sampler,
where a sampling adapter (saved for the sampler, not trainable) never changes. So such an adapter's
LoraWeights keeps its copies, with the version counters of the masters they came from (any in-place
write bumps them), and makes new ones only when those moved: the same bits as a fresh cast. A
trained adapter (its masters require grad) is cast per call as before: its copies would be stale
after every optim_step (torch's fused CPU AdamW bumps no version counter) and, kept, would cost
half its weights' memory again per resident adapter, for ~1% of a training pass.
"""

from __future__ import annotations

import torch


def cast_pair(lw, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(A, B) of LoraWeights `lw` in `dtype`: kept copies for a frozen adapter, fresh casts otherwise."""
    a, b = lw.a, lw.b
    if a.dtype == dtype and b.dtype == dtype:
        return a, b
    if a.requires_grad or b.requires_grad:  # trained: autograd's cast, per call
        return a.to(dtype), b.to(dtype)
    key = (dtype, a._version, b._version)
    kept = lw.casts
    if kept is None or kept[0] is not a or kept[1] is not b or kept[2] != key:
        kept = lw.casts = (a, b, key, a.to(dtype), b.to(dtype))
    return kept[3], kept[4]
