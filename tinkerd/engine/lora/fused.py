"""A training pass's LoRA linear as one autograd node whose GEMMs add the deltas in place.

Through autograd a LoRA linear is `base(x) + (s * x A^T) B^T`: the delta's GEMM writes a fresh
[M, out] tensor and an add makes a third, and in the backward the base's and the adapter's input
gradients are again two fresh [M, in] tensors that autograd sums. Here the base output takes each
run's delta through the GEMM itself (`addmm_`, beta 1: the product is summed into the output
while it is still in cache), and the backward's input gradient takes each run's share the same
way. SmolLM2-135M, rank 32, 2 x 256 tokens, forward_backward + optim_step in process (medians of
alternating steps, huge pages): 2 threads 1972 -> 1900 ms, 1 thread 3378 -> 3313 ms; 4 runs of
1 x 8 tokens in one shared pass, 2 threads, 467 -> 460 ms. Its backward is Python, so it needs the
GIL at every layer: nothing else in the engine process may hold the GIL for long while a pass runs
(engine/snapshots.py serialises on the step for that reason). A prototype with the same node but `mm` then an in-place
add gained nothing (2528 -> 2540 ms at 2 threads, against 2389 with addmm_): it is the summing
inside the GEMM, not the fewer autograd nodes, that counts.

Every training forward of an fp32 layer with a 3-D input goes through here, a run alone (one part,
every row) as well as a shared pass (engine/cotrain.py: one part per run, its block of rows at its
own width), and each part gets the same calls on the same operands whichever it is: its rows'
base output or input gradient (a row's bits do not depend on the other rows of the base GEMM),
then `addmm_` with its own A, B and M rows. A part narrower than the batch (padded to the widest
run) has its block copied out, summed into, and copied back, so its GEMMs see its M rows alone.
Runs of one shape use `baddbmm_` over all their blocks at once instead (`batched.fits`), where
`keeps_bits` found that it gives each matrix `addmm_`'s bits on this machine's MKL
(tests/unit/engine/test_cotrain.py checks the whole pass against each op alone). Where only the
backward's d B misses them (MKL at 2 threads on an Intel Xeon: SmolLM2's gate and up projections,
[8, 1536] x [1536, 32], whose long reduction mm splits another way than bmm), that one product runs
per run and the rest batched (`layout`): 4 runs of 1 x 8 tokens, 2 threads, in process, 22
alternated pairs: the pass 510 -> 499 ms, with those 60 of its 210 layers no longer run per run. A bf16 layer with fp32 master A/B keeps the autograd path
(lora/layers.py), as do 2-D inputs (a MoE block's shared expert, whose rows are routed per token).

The base GEMMs go through engine/gemm.py (oneDNN's on a CPU), and so do the LoRA products that
write a fresh tensor (x A^T, d B, and the two weight gradients, B's as (u^T d)^T) from
gemm.LORA_MIN_ROWS rows of a part up, and there the sums too (`gemm.add_lora`: oneDNN's product,
then an in-place add: 3-10% faster steps at 2 threads than addmm_, now that the product is
oneDNN's); below, the sums are torch's addmm_ (baddbmm_ batched). keeps_bits then finds the
batched form (MKL's bmm) off the per-part bits at those sizes, and such runs take one part each.

Scaling: a power of two scales x A^T exactly, as in lora_delta (engine/precision.py); any other
multiplies the product instead (addmm_'s alpha), PEFT's order.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from tinkerd.engine import gemm
from tinkerd.engine.lora.batched import probe_operands
from tinkerd.engine.precision import power_of_two


@dataclass(frozen=True)
class Part:
    """One run's rows of the layer's input [B, T, in]: batch rows [start, stop), its first `width`
    positions (the rest is padding), and its adapter's scaling."""

    start: int
    stop: int
    width: int
    scaling: float


class LoraLinear(torch.autograd.Function):
    """x [B, T, in] through the frozen base (weight, bias) plus each part's LoRA delta: A_1..A_k
    [R, in] then B_1..B_k [out, R] after the parts. `batched`: the parts are equal blocks of full
    width covering x in order, with one rank and power-of-two scalings, their products batched in the
    layout this machine keeps the parts' bits in (`layout`), or in the one named (BMM, D_B_APART)."""

    @staticmethod
    def forward(ctx, x, weight, bias, parts: tuple[Part, ...], batched: bool, *ab):
        k = len(parts)
        a_s, b_s = ab[:k], ab[k:]
        y = gemm.linear(x, weight, bias)
        if batched:
            ctx.d_b_apart = (batched if isinstance(batched, str) else layout_for(x, parts, a_s, b_s)) == D_B_APART
            xb = x.view(k, -1, x.shape[-1])
            a, b = torch.stack(a_s), torch.stack(b_s)
            us = torch.bmm(xb, a.transpose(1, 2))
            scales = [p.scaling for p in parts]
            if scales != [1.0] * k:
                us = us * (scales[0] if len(set(scales)) == 1 else us.new_tensor(scales)[:, None, None])
            y.view(k, -1, y.shape[-1]).baddbmm_(us, b.transpose(1, 2))
            ctx.save_for_backward(x, weight, a, b, us)
        else:
            kept = []
            for p, a, b in zip(parts, a_s, b_s):
                xs = _rows(x, p)
                u = gemm.lora_mm(xs, a.t(), xs.shape[0])
                us = u * p.scaling if power_of_two(p.scaling) and p.scaling != 1.0 else u
                _add_into(y, p, us, b.t(), _alpha(p))
                kept += [xs if p.width < x.shape[1] else None, us]
            # With no parts x is not needed (its frozen base's input gradient is d W): not kept, as autograd's linear.
            ctx.save_for_backward(x if parts else None, weight, *a_s, *b_s, *[t for t in kept if t is not None])
            ctx.narrow = [p.width < x.shape[1] for p in parts]
        ctx.parts, ctx.batched = parts, batched
        return y

    @staticmethod
    def backward(ctx, d):
        parts, k = ctx.parts, len(ctx.parts)
        x, weight, *rest = ctx.saved_tensors
        d = d.contiguous()
        dx = gemm.input_grad(d, weight) if ctx.needs_input_grad[0] else None
        if ctx.batched:
            a, b, us = rest
            db = d.view(k, -1, d.shape[-1])
            g_b = torch.bmm(db.transpose(1, 2), us)
            if ctx.d_b_apart:  # the product its part alone makes, one run at a time
                d_u = db.new_empty(k, db.shape[1], b.shape[2])
                for j in range(k):
                    torch.mm(db[j], b[j], out=d_u[j])
            else:
                d_u = torch.bmm(db, b)
            scales = [p.scaling for p in parts]
            if scales != [1.0] * k:
                d_u = d_u * (scales[0] if len(set(scales)) == 1 else d_u.new_tensor(scales)[:, None, None])
            if dx is not None:
                dx.view(k, -1, dx.shape[-1]).baddbmm_(d_u, a)
            g_a = torch.bmm(d_u.transpose(1, 2), x.view(k, -1, x.shape[-1]))
            return (dx, None, None, None, None, *g_a.unbind(0), *g_b.unbind(0))
        a_s, b_s, kept = rest[:k], rest[k:2 * k], iter(rest[2 * k:])
        g_as, g_bs = [], []
        for p, a, b, narrow in zip(parts, a_s, b_s, ctx.narrow):
            xs = next(kept) if narrow else _rows(x, p)
            us = next(kept)
            dp = _rows(d, p)
            g_b = gemm.lora_b_grad(dp, us, dp.shape[0])
            alpha = _alpha(p)
            g_bs.append(g_b if alpha == 1.0 else g_b * alpha)
            d_u = gemm.lora_mm(dp, b, dp.shape[0])
            if p.scaling != 1.0:
                d_u = d_u * p.scaling
            if dx is not None:
                _add_into(dx, p, d_u, a, 1.0)
            g_as.append(gemm.lora_mm(d_u.t(), xs, dp.shape[0]))
        return (dx, None, None, None, None, *g_as, *g_bs)


def _alpha(p: Part) -> float:
    """The factor addmm_ applies to the product u B^T: 1 where the scaling went into u."""
    return 1.0 if power_of_two(p.scaling) else p.scaling


def _whole(t: torch.Tensor, p: Part) -> bool:
    """Whether part p is all of t [B, T, dim] (a run alone): its rows need no slicing."""
    return p.start == 0 and p.stop == t.shape[0] and p.width == t.shape[1]


def _rows(t: torch.Tensor, p: Part) -> torch.Tensor:
    """The part's [M, dim] rows of t [B, T, dim]: a view at full width, a copy when narrower."""
    if _whole(t, p) and t.is_contiguous():  # one view instead of a slice and a view: a dispatch each
        return t.view(-1, t.shape[-1])
    block = t[p.start:p.stop]
    if p.width < t.shape[1]:
        block = block[:, :p.width]
    return block.reshape(-1, t.shape[-1])


def _add_into(out: torch.Tensor, p: Part, m1: torch.Tensor, m2: torch.Tensor, alpha: float) -> None:
    """out's rows of part p += alpha * m1 @ m2, as one sum over the part's M rows (gemm.add_lora)."""
    if _whole(out, p) and out.is_contiguous():
        gemm.add_lora(out.view(-1, out.shape[-1]), m1, m2, alpha, m1.shape[0])
        return
    block = out[p.start:p.stop, :p.width]
    if block.is_contiguous():  # full width, or a single row
        gemm.add_lora(block.view(-1, out.shape[-1]), m1, m2, alpha, m1.shape[0])
        return
    flat = block.reshape(-1, out.shape[-1])  # a copy of the rows
    gemm.add_lora(flat, m1, m2, alpha, m1.shape[0])
    block.copy_(flat.view(block.shape))


def parts_of(x: torch.Tensor, groups: list, loras: list) -> tuple[Part, ...]:
    """The parts of a layer's input for its routing groups (LoraContext.groups: one with every row
    alone, or consecutive blocks of a shared pass) and their adapters on this layer (None: none)."""
    if len(groups) == 1 and groups[0].rows is None:
        lw = loras[0]
        return () if lw is None else (Part(0, x.shape[0], x.shape[1], lw.scaling),)
    parts, start = [], 0
    for group, lw in zip(groups, loras):
        stop = start + group.rows.shape[0]
        if lw is not None:
            parts.append(Part(start, stop, group.width or x.shape[1], lw.scaling))
        start = stop
    return tuple(parts)


# Batched layouts of LoraLinear: every product batched, or all but d B (the backward's d_u = d B,
# one mm per run).
BMM = "bmm"
D_B_APART = "d B per run"


@functools.lru_cache(maxsize=1024)
def layout(g: int, m: int, in_features: int, out_features: int, rank: int, scalings: tuple[float, ...],
           dtype: torch.dtype, master: torch.dtype, threads: int) -> str | None:
    """The first batched layout (BMM, then D_B_APART) in which LoraLinear over g runs of one shape
    gives each run the bits of its part alone (addmm_), forward and backward, on random numbers of
    these shapes, on this machine; None if neither does. MKL's batched GEMM does not keep mm's bits
    at every shape (batched.keeps_bits)."""
    x, d, a, b = probe_operands(g, m, in_features, out_features, rank, dtype, master)
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(out_features, in_features, generator=gen).div_(in_features ** 0.5).to(dtype)
    parts = tuple(Part(i, i + 1, m, s) for i, s in enumerate(scalings))
    for way in (BMM, D_B_APART):
        with torch.enable_grad():
            xb, ab, bb = x.clone().requires_grad_(), [t.clone().requires_grad_() for t in a], [t.clone().requires_grad_() for t in b]
            together = LoraLinear.apply(xb, w, None, parts, way, *ab, *bb)
            together.backward(d)
            if all(_alone_equals(x, d, w, a, b, i, m, scalings[i], together, xb, ab, bb) for i in range(g)):
                return way
    return None


def _alone_equals(x, d, w, a, b, i: int, m: int, scaling: float, together, xb, ab, bb) -> bool:
    """Whether run i's part alone gives what it got in the batched node `together` (and its grads)."""
    with torch.enable_grad():
        xi, ai, bi = x[i:i + 1].clone().requires_grad_(), a[i].clone().requires_grad_(), b[i].clone().requires_grad_()
        alone = LoraLinear.apply(xi, w, None, (Part(0, 1, m, scaling),), False, ai, bi)
        alone.backward(d[i:i + 1])
    return all(torch.equal(p, q) for p, q in ((together[i:i + 1], alone), (xb.grad[i:i + 1], xi.grad),
                                             (ab[i].grad, ai.grad), (bb[i].grad, bi.grad)))


def keeps_bits(g: int, m: int, in_features: int, out_features: int, rank: int, scalings: tuple[float, ...],
               dtype: torch.dtype, master: torch.dtype, threads: int) -> bool:
    """Whether LoraLinear over g runs of one shape keeps each run's bits in some batched layout on this
    machine (`layout`): batched.fits asks it instead of batched.keeps_bits for this node (same signature)."""
    return layout(g, m, in_features, out_features, rank, scalings, dtype, master, threads) is not None


def layout_for(x: torch.Tensor, parts: tuple[Part, ...], a_s, b_s) -> str:
    """The batched layout of a pass's layer (the parts equal blocks of x): the probed one on a CPU
    (batched.fits took the layer only where there is one), BMM elsewhere (CUDA keeps no bits)."""
    if x.device.type != "cpu":
        return BMM
    k = len(parts)
    got = layout(k, (x.shape[0] // k) * x.shape[1], x.shape[-1], b_s[0].shape[0], a_s[0].shape[0],
                 tuple(p.scaling for p in parts), x.dtype, a_s[0].dtype, torch.get_num_threads())
    return got or BMM


def fits(x: torch.Tensor, base: torch.nn.Linear, loras: list) -> bool:
    """Whether this layer's training forward takes LoraLinear: a 3-D input, a frozen base, and
    every adapter on it in the input's dtype (fp32 masters on a bf16 base keep autograd's path).
    A layer with no adapter of any of the pass's runs (a run trained without its MLP, say) takes it
    too, with no parts, where its GEMMs are oneDNN's (gemm.py): alone and in a shared pass alike, so
    no base GEMM of a fp32 training pass is MKL's, whose rows round by the batch on some CPUs
    (engine/rowbits.py: an Intel Xeon at 2 threads, from 17 rows)."""
    return (x.dim() == 3 and not base.weight.requires_grad and (base.bias is None or not base.bias.requires_grad)
            and (any(lw is not None for lw in loras) or gemm.ours(x, base.weight))
            and all(lw is None or (lw.a.dtype == x.dtype and lw.b.dtype == x.dtype) for lw in loras))


def lora_linear(x: torch.Tensor, base: torch.nn.Linear, parts: tuple[Part, ...], loras: list, batched: bool) -> torch.Tensor:
    present = [lw for lw in loras if lw is not None]
    return LoraLinear.apply(x, base.weight, base.bias, parts, batched, *(lw.a for lw in present), *(lw.b for lw in present))
