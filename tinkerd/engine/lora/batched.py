"""Several runs' LoRA deltas on one layer as batched GEMMs, when their blocks have the same shape.

In a shared training pass (engine/cotrain.py) each run's delta on a layer is its own small GEMMs:
4 runs of 1 x 32 tokens on SmolLM2-135M made ~4,600 GEMMs of [32, 32] x [32, 576] and the like per
pass, each ~20-60 us in MKL at 2 threads, ~220 ms of a 1,124 ms pass. Where every run's block has
the same rows, width and rank, torch.bmm does a layer's G GEMMs of each kind in one call (MKL's
batched GEMM), 1.4-2.3x faster than 4 mm calls at these sizes: 1,124 -> ~975 ms per pass
(in-process, 2 threads).

Each run must still get the bits of its op alone, where `lora_delta` runs through mm and autograd.
So this Function computes, per run, exactly the products autograd computes for that mm chain, with
the same operands in the same order and transposition (torch's mm_mat1_backward and
mm_mat2_backward for x @ A^T and u @ B^T): u = x A^T, delta = (s u) B^T; backward d(su) = d B,
dB = d^T (s u), du = s d(su), dx = du A, dA = du^T x. MKL's batched GEMM gives each matrix the
bits of the single GEMM (tests/unit/engine/test_cotrain.py checks the whole pass against each op
alone). Its gradients come out in each parameter's own layout: fused AdamW on CPU needs that
(engine/adam.py: add_grad), and autograd's bmm backward gives A's gradient transposed.
"""

from __future__ import annotations

import torch

from tinkerd.engine.precision import power_of_two


class SameShapeDeltas(torch.autograd.Function):
    """x [G, M, in], one scaling per run (powers of two), then A_1..A_G [R, in] and B_1..B_G [out, R]:
    every run's delta [G, M, out]."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, scalings: tuple[float, ...], *weights: torch.Tensor) -> torch.Tensor:
        g = len(scalings)
        a, b = torch.stack(weights[:g]), torch.stack(weights[g:])
        u = torch.bmm(x, a.transpose(1, 2))
        scale = None if all(s == 1.0 for s in scalings) else u.new_tensor(scalings)[:, None, None]
        us = u if scale is None else u * scale
        ctx.save_for_backward(x, a, b, us)
        ctx.scale = scale
        return torch.bmm(us, b.transpose(1, 2))

    @staticmethod
    def backward(ctx, d: torch.Tensor):
        x, a, b, us = ctx.saved_tensors
        d_us = torch.bmm(d, b)
        g_b = torch.bmm(d.transpose(1, 2), us)
        d_u = d_us if ctx.scale is None else d_us * ctx.scale
        g_x = torch.bmm(d_u, a)
        g_a = torch.bmm(d_u.transpose(1, 2), x)
        return (g_x, None, *g_a.unbind(0), *g_b.unbind(0))


def same_shape_deltas(xs: torch.Tensor, loras: list) -> torch.Tensor:
    """xs [B, T, in] whose B rows split evenly into len(loras) runs' blocks; loras: each run's
    LoraWeights. Their deltas, [B, T, out]."""
    g = len(loras)
    x = xs.reshape(g, -1, xs.shape[-1])
    scalings = tuple(lw.scaling for lw in loras)
    delta = SameShapeDeltas.apply(x, scalings, *(lw.a for lw in loras), *(lw.b for lw in loras))
    return delta.view(*xs.shape[:-1], delta.shape[-1])


def fits(x: torch.Tensor, groups: list, loras: list) -> bool:
    """Whether same_shape_deltas gives every group its op-alone bits: more than one group on CPU,
    every one with an adapter of this layer at x's dtype, the same rank and rows, at the batch's
    width, and a power-of-two scaling (another scales the output, in PEFT's order)."""
    # CPU only: MKL's batched GEMM was checked to give each matrix the single GEMM's bits; cuBLAS
    # picks its batched kernels apart from its single ones, and no GPU has checked it yet.
    if len(groups) < 2 or x.device.type != "cpu" or any(lw is None for lw in loras):
        return False
    rows, shape = groups[0].rows.shape[0], loras[0].a.shape
    t = x.shape[1]
    return (all(group.rows.shape[0] == rows and (group.width or t) == t for group in groups)
            and all(lw.a.shape == shape and lw.a.dtype == x.dtype and lw.b.dtype == x.dtype
                    and power_of_two(lw.scaling) for lw in loras))
