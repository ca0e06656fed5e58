"""Causal attention of an fp32 training pass as oneDNN GEMMs and torch's softmax, in query blocks.

engine/causal.py runs PyTorch's CPU flash-attention kernel per query block. In fp32 that kernel's
inner products are MKL's sgemm (AVX2 on AMD CPUs, engine/gemm.py), in tiles of a few dozen rows,
with its own exp and rescaling between them. Up to a few thousand tokens the whole block of scores
fits in memory, so here each block is four plain GEMMs forward and back on oneDNN, over all the
query heads that share a key/value head at once (grouped-query attention: 3 x the rows a head has
on SmolLM2), with torch's softmax and its backward between them. SmolLM2's attention, 2 rows, fp32,
forward + backward of one layer, AMD EPYC Zen 5, flash blocks -> these (ms): 1 thread 256 tokens
8.4 -> 6.7, 512: 28.6 -> 19.8, 1024: 106 -> 70; 2 threads 5.2 -> 4.4, 16.7 -> 12.2, 74 -> 53;
below 224 tokens 0.6-1.0x, so the flash blocks keep those. See benchmarks/causal_attention.py.

The blocks are cut from the width alone (`spans`), each row of queries is a row of its GEMMs, and
every (row of the batch, key/value head) pair gets its own calls, so a row's bits depend on its
width alone, as with the flash blocks (a shared pass gives each run its bits, engine/grouped.py).
The probabilities are kept for the backward while a layer's are at most KEEP_CELLS floats, and made
again there, the same calls on the same operands (so the same bits), past that. A query that sees
no key at all (left padding) gets zeros, as SDPA gives.

A bf16 pass's attention runs here too, in fp32: q, k and v are widened, and the output and their
gradients rounded to bf16 once. The bf16 flash kernel rounds the probabilities to bf16 before their
product with the values and its per-call cost is higher: SmolLM2's shapes, 2 rows, forward +
backward of a layer, bf16 flash kernel (HF's SDPA) -> here: 1 thread 256 tokens 13.1 -> 8.2 ms,
512: 45.0 -> 24.0; 2 threads 7.5 -> 5.2, 22.9 -> 14.1. So it is faster and nearer the exact answer.
"""

from __future__ import annotations

import functools

import torch

from tinkerd.engine import cpu, gemm

# Queries per block: fewer, larger GEMMs against skipping more of the masked half. 128 (two blocks at
# 256 tokens, four at 512) was fastest up to 1024 tokens on the CPU above; 1/8 of the width beyond.
MIN_BLOCK = 128
BLOCKS = 8
# Widths this runs at: from where it beats the flash blocks (engine/causal.py keeps the narrower ones)
# to where a block's scores (heads per key head x T/8 x T floats) still stay a few tens of MB.
MIN_WIDTH, MAX_WIDTH = 224, 4096
# A layer's kept probabilities, in floats: ~3/4 of rows x heads x T^2; 2 x 256 tokens of SmolLM2 keep
# 0.9 M (3.5 MB a layer), 2 x 512 3.2 M.
KEEP_CELLS = 1 << 22


def spans(t: int) -> list[tuple[int, int]]:
    """The query blocks [start, stop) of a width-t attention: a function of t alone."""
    size = max(MIN_BLOCK, t // BLOCKS)
    return [(s, min(t, s + size)) for s in range(0, t, size)]


def fits(q: torch.Tensor, sees: torch.Tensor | None = None) -> bool:
    """Whether these blocks take an attention of q [B, H, T, d] (mask rules aside: causal._fits): fp32
    or bf16, a width in range, oneDNN on, a CPU where they beat the flash kernel at this dtype
    (engine/cpu.py: not an Intel CPU's MKL in fp32, nor AMX in bf16), and a mask (if any) of HF's
    [B or 1, 1, T, T] shape, one for every head."""
    return (q.dtype in (torch.float32, torch.bfloat16) and MIN_WIDTH <= q.shape[2] <= MAX_WIDTH
            and (sees is None or (sees.dim() == 4 and sees.shape[1] == 1 and sees.shape[0] in (1, q.shape[0])))
            and gemm.onednn() and cpu.gemm_attention(q.dtype))


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sees: torch.Tensor | None,
           scale: float | None) -> torch.Tensor:
    """GemmBlocks' attention; of bf16 q, k, v computed in fp32 and rounded once to bf16 (module docstring)."""
    if q.dtype == torch.float32:
        return GemmBlocks.apply(q, k, v, sees, scale)
    return GemmBlocks.apply(q.float(), k.float(), v.float(), sees, scale).to(q.dtype)


@functools.lru_cache(maxsize=64)
def _causal(n: int, group: int) -> torch.Tensor:
    """The additive mask of a block's own n keys for its n x group query rows (row (i, h) sees keys <= i)."""
    sees = torch.ones(n, n, dtype=torch.bool).tril()
    return torch.zeros(n, group, n).masked_fill_(~sees[:, None, :], float("-inf")).view(n * group, n)


class GemmBlocks(torch.autograd.Function):
    """q [B, H, T, d]; k, v [B, H_kv, T, d]; sees: HF's boolean mask [B or 1, 1, T, T] (True = attend)
    or None (causal); returns [B, H, T, d] laid out [B, T, H, d], as HF hands it on. Results are made
    block by block and joined in one copy each (`torch.cat`), not copied out per block: at 2 threads a
    small strided copy costs about what a block's GEMM does."""

    @staticmethod
    def forward(ctx, q, k, v, sees, scale):
        rows, heads, t, d = q.shape
        kv = k.shape[1]
        group = heads // kv
        scale = d ** -0.5 if scale is None else scale
        # Scaled queries [B, H_kv, T, group, d]: a block's rows of one key head are one contiguous matrix.
        qs = torch.empty(rows, kv, t, group, d, dtype=q.dtype)
        torch.mul(q.unflatten(1, (kv, group)).transpose(2, 3), scale, out=qs)
        k, v = k.contiguous(), v.contiguous()
        blocks = spans(t)
        keep = rows * heads * sum((e - s) * e for s, e in blocks) <= KEEP_CELLS
        kept, outs = [], []
        for b in range(rows):
            for j in range(kv):
                qj = qs[b, j].view(t * group, d)
                for s, e in blocks:
                    p = _probs(qj[s * group:e * group], k[b, j, :e], sees, b, s, e, group)
                    outs.append(gemm._linear(p, v[b, j, :e].t(), None))
                    if keep:
                        kept.append(p)
        ctx.save_for_backward(qs, k, v, *kept)
        ctx.sees, ctx.scale = sees, scale
        out = torch.cat(outs).view(rows, kv, t, group, d).transpose(1, 2).contiguous()
        return out.view(rows, t, heads, d).transpose(1, 2)

    @staticmethod
    def backward(ctx, g):
        qs, k, v, *kept = ctx.saved_tensors
        rows, kv, t, group, d = qs.shape
        blocks = spans(t)
        gs = torch.empty_like(qs)
        gs.copy_(g.unflatten(1, (kv, group)).transpose(2, 3))
        # Each block's queries and output gradients transposed, [B, H_kv, d, rows of the block], made
        # here in one copy a block: oneDNN would copy a transposed input operand per call.
        qt = [qs[:, :, s:e].permute(0, 1, 4, 2, 3).contiguous() for s, e in blocks]
        gt = [gs[:, :, s:e].permute(0, 1, 4, 2, 3).contiguous() for s, e in blocks]
        kept = iter(kept)
        g_q, g_k, g_v = [], [], []
        for b in range(rows):
            for j in range(kv):
                qj, gj = qs[b, j].view(t * group, d), gs[b, j].view(t * group, d)
                kb, vb = k[b, j], v[b, j]
                d_ks, d_vs = [], []
                for n, (s, e) in enumerate(blocks):
                    lo, hi = s * group, e * group
                    p = next(kept, None)
                    if p is None:
                        p = _probs(qj[lo:hi], kb[:e], ctx.sees, b, s, e, group)
                    d_s = torch._softmax_backward_data(gemm._linear(gj[lo:hi], vb[:e], None), p, -1, p.dtype)
                    g_q.append(gemm._linear(d_s, kb[:e].t(), None))
                    # [d, e]: the gradient of the block's keys and values, transposed.
                    d_ks.append(gemm._linear(qt[n][b, j].view(d, hi - lo), d_s.t(), None))
                    d_vs.append(gemm._linear(gt[n][b, j].view(d, hi - lo), p.t(), None))
                # The last block sees every key: the earlier blocks' gradients are summed into its own.
                for sums, parts in ((g_k, d_ks), (g_v, d_vs)):
                    total = parts[-1]
                    for part in reversed(parts[:-1]):
                        total[:, :part.shape[1]].add_(part)
                    sums.append(total)
        g_q = torch.mul(torch.cat(g_q).view(rows, kv, t, group, d).transpose(1, 2), ctx.scale,
                        out=qs.new_empty(rows, t, kv, group, d))
        g_k, g_v = (torch.stack(x).view(rows, kv, d, t).transpose(2, 3) for x in (g_k, g_v))
        return g_q.view(rows, t, kv * group, d).transpose(1, 2), g_k, g_v, None, None


def _probs(q: torch.Tensor, k: torch.Tensor, sees: torch.Tensor | None, b: int, s: int, e: int,
           group: int) -> torch.Tensor:
    """softmax(q k^T + mask) of block [s, e): q [(e - s) * group, d] scaled, k [e, d]; [(e - s) * group, e]."""
    scores = gemm._linear(q, k, None)
    if sees is None:
        scores[:, s:].add_(_causal(e - s, group))
        return torch.softmax(scores, -1)
    m = sees[b if sees.shape[0] > 1 else 0, 0, s:e, :e]
    scores.view(e - s, group, e).masked_fill_(~m[:, None, :], float("-inf"))
    p = torch.softmax(scores, -1)
    blind = ~m.any(-1)
    if bool(blind.any()):  # queries that see no key: SDPA's zeros, not softmax's NaN
        p.view(e - s, group, e)[blind] = 0.0
    return p
