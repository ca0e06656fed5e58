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
bits of the single GEMM, in fp32 and bf16, at most shapes but not all (rank 1; at 2 threads ranks
5-7 and 9-11), so `fits` takes a shape only once `keeps_bits` has checked it on the machine
(tests/unit/engine/test_cotrain.py checks the whole pass against each op alone in both). Its gradients come out in each parameter's own layout: fused AdamW
on CPU needs that (engine/adam.py: add_grad), and autograd's bmm backward gives A's gradient
transposed.

On CUDA the bits are not the op's alone (an H200's cuBLAS: bmm != mm, benchmarks/gpu_check.py), but
there a shared pass keeps them in no case (the base GEMMs over all runs' rows round differently,
tests/gpu/test_cuda_engine.py), and a GPU engine is bound by its kernel launches (docs/testing.md):
one bmm per product instead of one mm per run.
"""

from __future__ import annotations

import functools

import torch

from tinkerd.engine.precision import power_of_two


class SameShapeDeltas(torch.autograd.Function):
    """x [G, M, in], one scaling per run (powers of two), then A_1..A_G [R, in] and B_1..B_G [out, R]:
    every run's delta [G, M, out]."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, scalings: tuple[float, ...], *weights: torch.Tensor) -> torch.Tensor:
        g = len(scalings)
        # A bf16 base casts the fp32 master A/B for the pass, as the per-run path does (engine/precision.py).
        a, b = torch.stack(weights[:g]).to(x.dtype), torch.stack(weights[g:]).to(x.dtype)
        u = torch.bmm(x, a.transpose(1, 2))
        # One scaling for all runs is a Python number, as alone; several, a [G, 1, 1] tensor (the same
        # products: powers of two scale exactly).
        scale = scalings[0] if len(set(scalings)) == 1 else u.new_tensor(scalings)[:, None, None]
        ctx.unit = not torch.is_tensor(scale) and scale == 1.0
        us = u if ctx.unit else u * scale
        ctx.save_for_backward(x, a, b, us)
        ctx.scale, ctx.master = scale, weights[0].dtype
        return torch.bmm(us, b.transpose(1, 2))

    @staticmethod
    def backward(ctx, d: torch.Tensor):
        x, a, b, us = ctx.saved_tensors
        d_us = torch.bmm(d, b)
        g_b = torch.bmm(d.transpose(1, 2), us)
        d_u = d_us if ctx.unit else d_us * ctx.scale
        g_x = torch.bmm(d_u, a)
        g_a = torch.bmm(d_u.transpose(1, 2), x)
        # Back to the master dtype, as autograd's cast backward does alone (a no-op in fp32): one cast
        # of all runs' gradients, the same bits as one per run in 1/G of the launches.
        return (g_x, None, *g_a.to(ctx.master).unbind(0), *g_b.to(ctx.master).unbind(0))


def same_shape_deltas(xs: torch.Tensor, loras: list) -> torch.Tensor:
    """xs [B, T, in] whose B rows split evenly into len(loras) runs' blocks; loras: each run's
    LoraWeights. Their deltas, [B, T, out]."""
    g = len(loras)
    x = xs.reshape(g, -1, xs.shape[-1])
    scalings = tuple(lw.scaling for lw in loras)
    delta = SameShapeDeltas.apply(x, scalings, *(lw.a for lw in loras), *(lw.b for lw in loras))
    return delta.view(*xs.shape[:-1], delta.shape[-1])


def fits(x: torch.Tensor, groups: list, loras: list, probe=None) -> bool:
    """Whether same_shape_deltas takes this layer: more than one group, every one with an adapter of
    this layer, the same rank, master dtype and rows, at the batch's width, a power-of-two scaling
    (another scales the output, in PEFT's order), and on the CPU shapes whose bits keeps_bits found
    kept on this machine (`probe`: another path's check of the same shapes, engine/lora/fused.py's)."""
    if len(groups) < 2 or any(lw is None for lw in loras):
        return False
    rows, shape, master = groups[0].rows.shape[0], loras[0].a.shape, loras[0].a.dtype
    t = x.shape[1]
    return (all(group.rows.shape[0] == rows and (group.width or t) == t for group in groups)
            and all(lw.a.shape == shape and lw.a.dtype == master and lw.b.dtype == master
                    and power_of_two(lw.scaling) for lw in loras)
            and (x.device.type != "cpu"  # on CUDA no bits are kept either way (module docstring)
                 or (probe or keeps_bits)(len(loras), rows * t, x.shape[-1], loras[0].b.shape[0], shape[0],
                                          tuple(lw.scaling for lw in loras), x.dtype, master, torch.get_num_threads())))


def probe_operands(g: int, m: int, in_features: int, out_features: int, rank: int, dtype: torch.dtype,
                   master: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, list, list]:
    """A bit probe's random input x [g, m, in], output gradient d [g, m, out] and g adapters' A
    [rank, in] and B [out, rank], the same numbers every call (keeps_bits, fused.keeps_bits)."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(g, m, in_features, generator=gen).to(dtype)
    d = torch.randn(g, m, out_features, generator=gen).to(dtype)
    a = [torch.randn(rank, in_features, generator=gen).div_(in_features ** 0.5).to(master) for _ in range(g)]
    b = [torch.randn(out_features, rank, generator=gen).div_(rank ** 0.5).to(master) for _ in range(g)]
    return x, d, a, b


@functools.lru_cache(maxsize=1024)
def keeps_bits(g: int, m: int, in_features: int, out_features: int, rank: int, scalings: tuple[float, ...],
               dtype: torch.dtype, master: torch.dtype, threads: int) -> bool:
    """Whether SameShapeDeltas gives each of g runs of m rows the bits its per-run path (lora_delta
    through autograd) gives alone, forward and backward, on random numbers of these shapes, on this
    machine: asked once per shape (`threads` keys the cache). MKL's batched GEMM keeps mm's bits at
    most shapes but not all: at rank 1 (mm takes a matrix-vector kernel) at any thread count, and at
    2 threads at ranks 5-7 and 9-11 (d A's GEMM has rank rows: engine/rowbits.py) and at 6 rows. Where
    it does not, the layer takes the per-run GEMMs. CPU tensors: `fits` asks only for a CPU pass."""
    from tinkerd.engine.precision import lora_delta

    x, d, a, b = probe_operands(g, m, in_features, out_features, rank, dtype, master)
    with torch.enable_grad():
        xb, ab, bb = x.clone().requires_grad_(), [t.clone().requires_grad_() for t in a], [t.clone().requires_grad_() for t in b]
        together = SameShapeDeltas.apply(xb, scalings, *ab, *bb)
        together.backward(d)
        for i in range(g):
            xi, ai, bi = x[i].clone().requires_grad_(), a[i].clone().requires_grad_(), b[i].clone().requires_grad_()
            alone = lora_delta(xi, ai.to(dtype), bi.to(dtype), scalings[i])
            alone.backward(d[i])
            if not all(torch.equal(p, q) for p, q in ((together[i], alone), (xb.grad[i], xi.grad), (ab[i].grad, ai.grad),
                                                      (bb[i].grad, bi.grad))):
                return False
    return True
