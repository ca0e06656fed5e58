"""The unembedding (LM head) of one run's rows, or of several runs' (a shared pass): target
logprobs, then their backward.

Every Tinker loss is a function of the target logprobs alone (engine/training.py), so the head is
a pass of its own: `HeadPass(rt, hidden, targets)` gives logprob[target] - logsumexp(logits) per
position, and `backward(g)` turns d loss / d logprobs into d loss / d hidden plus the grads of the
head's own LoRA. The [M, V] logits are the biggest tensor of a step (SmolLM2, 512 positions: 100 MB
and 58 of its ~330 GFLOP), so how they are cut matters:

- Tiled (a plain fp32 head, with or without this run's LoRA on it): rows in blocks of at most
  ROW_BLOCK, the vocabulary in tiles of TILE_CELLS / ROW_BLOCK columns whatever the number of rows
  (so a row's logits are the same bits in any block), the logsumexp combined across tiles,
  and the backward written out (d logits = g * (onehot(target) - softmax), made in place in the
  kept tile, then one GEMM per tile into d hidden and the LoRA's grads). The forward leaves each
  tile holding exp(logit - its row's max), which its logsumexp sums, so the backward's softmax is
  one scaling of it; exponentiating again there (exp(logit - lse)) cost 512 positions of SmolLM2
  ~12 ms at 1 thread and ~9 at 2. The head LoRA's products are oneDNN's from LORA_MIN_ROWS rows of
  a block (its comment): with both, that head pass with a rank-32 LoRA, fwd + bwd, median of 15,
  alternated processes, went from 345-348 to 300-305 ms at 1 thread and 185-192 to 158-172 at 2
  (128 rows: 90 -> 81-83 and 50-51 -> 46.5; 32 rows unchanged). Whole-row GEMMs over a
  vocabulary tile run nearer the machine's rate than a few rows against the whole vocabulary
  (fp32, [512, 576] x [576, 8192] at 130 GFLOP/s on 2 threads, [128, 576] x [576, 49152] at 93),
  and the in-place softmax saves autograd's [M, V] temporaries. 512 positions of SmolLM2 through
  the head and back, median of 6: 1 thread 876 -> 783 ms, 1070 -> 876 with a rank-32 LoRA on the
  head (the SDK's default, train_unembed); 2 threads 581 -> 462 and 688 -> 516. Tiles of 2048
  columns (4 MB at 512 rows) rather than 8192 (16 MB) took that pass, fwd + bwd, median of 10,
  from 653 to 610 ms at 1 thread (683 -> 634 with the head LoRA) and from 342 to 328 at 2 (376 ->
  337); the forward GEMM alone 277 -> 260 and 177 -> 151 ms (AMD EPYC, 2 MB L2 a core, 32 MB
  L3). At 32 and 128 rows 2-7% faster, at 8 rows the same.
- Otherwise (a bf16 head, Gemma's logit softcap, a head with a bias): rows in chunks through the
  head module and autograd, the path HF's own forward takes, with the log-softmax of the targets
  one node (TargetLogprobs: torch's logsumexp to the bit, its backward from the kept exponentials).

Up to KEEP_CELLS logits are kept from the forward to the backward, and beyond that too on a model
whose logits are a small part of what its decoder keeps for the backward anyway (`keeps`);
otherwise each block is recomputed in the backward, so memory holds one tile (or chunk) at a time.
Keeping or recomputing gives the same bits: the same kernels on the same inputs. A run's blocks depend only on its number
of rows, so its head gives the same bits alone and in a shared pass (engine/cotrain.py), where the
runs' blocks share the GEMMs (HeadPass's docstring).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from tinkerd.engine import cpu, gemm

if TYPE_CHECKING:
    from tinkerd.engine.engine import ModelRuntime

# Up to this many [M, V] cells (256 MB fp32) the logits are kept rather than recomputed: the second
# head forward was 6% of a SmolLM2 step (2 x 256 tokens: 29 of ~330 GFLOP).
KEEP_CELLS = 1 << 26
# Past KEEP_CELLS the logits are still kept where a position's are at most BODY_SHARE of the floats
# its decoder keeps for the backward (estimated as 4 x (hidden + intermediate) per layer; SmolLM2's
# ~1.5 MB a position measured against this 1.0): then they add little to a step's peak, which comes
# in the backward, not at the end of the forward. SmolLM2 (49k vocabulary, 2 threads, in process):
# a GRPO-shaped forward_backward (4 prompts of 256 tokens, 8 samples of 64 each: 3,100 head rows,
# 610 MB of logits) 12.1 -> 11.1 s, peak RSS 6,462 -> 6,504 MB; 4 x 1,025 tokens (806 MB) 17.5 ->
# 16.0 s, 7,419 -> 7,503 MB. Qwen3-0.6B (152k vocabulary, 28 layers of 1,024 + 3,072) keeps too;
# Gemma 3 270M's shape (262k, 18 layers of 640 + 2,048) only up to KEEP_CELLS.
BODY_SHARE = 0.5
# Tiled: rows per block, and logits cells per GEMM (4 MB fp32: the tile is in cache when the
# logsumexp and, in the backward, the softmax pass over it run, and MKL writes it faster than a
# 16 MB one; module docstring).
ROW_BLOCK = 512
TILE_CELLS = 1 << 20
MIN_TILE = 2048
# Autograd chunks: CHUNK_CELLS cells each, but never fewer rows than this: the head's GEMMs run far below
# the machine's rate on a few rows (1 thread, 512 rows through the head and back: at 49k vocab
# 633 ms in 85-row chunks, 514 in 128; at 152k, 27-row chunks took 6.0 s against 3.4 s in 128).
CHUNK_MIN_ROWS = 128
CHUNK_CELLS = 1 << 22
# From this many rows of a run's block the head LoRA's three rank-sized products per tile (the
# delta into the logits, d B and d^T xs) are oneDNN's (engine/gemm.py), below MKL's. SmolLM2's tile
# of 2048 columns, rank 32, ms per tile for the three, MKL / oneDNN: 1 thread 8 rows 0.040 / 0.061,
# 32 rows 0.146 / 0.106, 64 rows 0.296 / 0.170, 512 rows 2.31 / 0.99; 2 threads 32 rows 0.081 /
# 0.082, 64 rows 0.155 / 0.110, 512 rows 1.19 / 0.55 (AMD EPYC Zen 5). A run's blocks have the same
# rows alone and in a shared pass, so they take the same products either way. On an Intel CPU (MKL's
# AVX-512 kernels, engine/cpu.py) MKL's throughout: a step 1.009-1.014x (Xeon with AMX, 1 and 2 threads).
LORA_MIN_ROWS = gemm.NEVER if cpu.mkl_avx512() else 64


def head_lora(rt: "ModelRuntime", slot: int | None = None) -> tuple[torch.Tensor, torch.Tensor, float] | None:
    """(A, B, scaling) of the LoRA the adapter in `slot` (default: the routed run's) has on the
    unembedding, if it trains it."""
    head = rt.model.get_output_embeddings()
    if slot is None:
        if not rt.ctx.groups:
            return None
        slot = rt.ctx.groups[0].slot
    lw = getattr(head, "adapters", {}).get(slot)
    return (lw.a, lw.b, lw.scaling) if lw is not None else None


def keeps(rt: "ModelRuntime", rows: int) -> bool:
    """Whether the head keeps `rows` rows' logits from its forward to its backward (KEEP_CELLS,
    BODY_SHARE, and past KEEP_CELLS only where they fit in memory: Recompute.fits)."""
    vocab = rt.vocab_size
    if rows * vocab <= KEEP_CELLS:
        return True
    config = rt.model.config
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    width = (getattr(text, "hidden_size", 0) or 0) + (getattr(text, "intermediate_size", 0) or 0)
    # And only while they fit: a body that recomputes its activations (engine/recompute.py) holds
    # little, and then the logits would be most of the step's peak.
    return (vocab <= BODY_SHARE * 4 * width * (getattr(text, "num_hidden_layers", 0) or 0)
            and rt.recompute.fits(rt, rows * vocab * 4))


def tiled(rt: "ModelRuntime", loras: list) -> bool:
    """Whether the head of runs with these head LoRAs (None: none) takes the tiled path."""
    head = rt.model.get_output_embeddings()
    base = getattr(head, "base", head)
    return (isinstance(base, torch.nn.Linear) and base.bias is None and base.weight.dtype == torch.float32
            and not getattr(rt.model.config, "final_logit_softcapping", None)
            and all(lora is None or lora[0].dtype == torch.float32 for lora in loras))


def chunk_rows(vocab: int) -> int:
    """Rows of each chunk of the autograd path (CHUNK_CELLS logits, at least CHUNK_MIN_ROWS rows)."""
    return max(CHUNK_MIN_ROWS, CHUNK_CELLS // vocab)


def direct_b_grad(rows: int) -> bool:
    """Whether a head LoRA's B gradient over a block of `rows` is made with MKL (below
    LORA_MIN_ROWS, or without oneDNN) as d^T @ xs into B's own layout, rather than as xs^T @ d and
    transposed at the end (oneDNN's always is the latter). SmolLM2's 6 tiles of 8192 (fp32,
    rank 32), ms per block, xs^T @ d + transpose against d^T @ xs: 1 thread 8 rows 2.63 / 0.47,
    128 rows 9.6 / 8.6, 256 rows 18.6 / 16.7, 384 rows 24.9 / 26.9, 512 rows 31.2 / 39.4;
    2 threads 8 rows 4.0 / 0.47, 256 rows 14.6 / 10.2, 512 rows 31.8 / 21.0. With the 24 tiles of
    2048 since, a whole head backward (its logits recomputed) the same way: 1 thread 8 rows 28.0 /
    23.6, 256 rows 309 / 309, 512 rows 590 / 596; 2 threads 8 rows 19.5 / 15.0, 512 rows 328 / 323,
    so the rule stands. Alone and in a shared pass a run's blocks have the same rows, so they take
    the same way."""
    return rows <= 256 or torch.get_num_threads() > 1


def tiles(vocab: int) -> list[slice]:
    """The tiled path's vocabulary tiles: TILE_CELLS / ROW_BLOCK columns each (at least MIN_TILE),
    whatever the number of rows, so a row's logits come from the same GEMMs alone and in a shared pass."""
    width = min(vocab, max(MIN_TILE, TILE_CELLS // ROW_BLOCK))
    return [slice(j, min(j + width, vocab)) for j in range(0, vocab, width)]


def row_blocks(m: int) -> list[int]:
    """Sizes of the blocks one run's m rows go through the head in: at most ROW_BLOCK each, as even
    as can be (1025 rows: 342 + 342 + 341), so none is one of the few rows MKL serves with another
    kernel (engine/cotrain.py: MIN_TOKENS) and a block's rows give the same bits in any GEMM."""
    n = max(1, -(-m // ROW_BLOCK))
    return [m // n + (1 if i < m % n else 0) for i in range(n)]


def packing(ms: list[int]) -> list[list[tuple[int, int]]]:
    """Per head GEMM over runs of `ms` rows side by side, its blocks as (run, rows): each run's
    row_blocks, consecutive ones of several runs together while they fit in ROW_BLOCK rows."""
    gemms: list[list[tuple[int, int]]] = []
    for k, m in enumerate(ms):
        for n in row_blocks(m):
            if gemms and sum(rows for _, rows in gemms[-1]) + n <= ROW_BLOCK:
                gemms[-1].append((k, n))
            else:
                gemms.append([(k, n)])
    return gemms


def gemm_rows(ms: list[int]) -> list[int]:
    """Rows of each of the head's GEMMs over runs of `ms` rows side by side (packing)."""
    return [sum(rows for _, rows in gemm) for gemm in packing(ms)]


@dataclass(frozen=True)
class _Block:
    """One run's block of rows inside a GEMM of the head: its rows in that GEMM, its part (run), its LoRA."""

    at: slice
    part: int
    lora: tuple[torch.Tensor, torch.Tensor, float] | None


class HeadPass:
    """The head over `hidden` [M, H] (detached from the body) for `targets` [M] or [M, K].

    `parts` (the tiled path only): [(rows, head LoRA or None)], consecutive spans of `hidden` that
    belong to different runs of a shared pass (engine/cotrain.py). Each run's rows are cut in the
    blocks it gets alone (row_blocks), and consecutive blocks of several runs go through one GEMM
    per tile, up to ROW_BLOCK rows: the tile width is the same for any number of rows, a row's
    logits do not depend on the other rows of its GEMM, and everything a run sums over (its LoRA's
    grads) stays within its own blocks, so each run gets the bits it gets alone. Four runs of 8
    tokens stream the [V, H] head weight twice per pass instead of eight times."""

    def __init__(self, rt: "ModelRuntime", hidden: torch.Tensor, targets: torch.Tensor, keep: bool,
                 parts: list[tuple[int, tuple | None]] | None = None):
        self.rt, self.hidden, self.targets = rt, hidden, targets
        m, vocab = hidden.shape[0], rt.vocab_size
        self.keep = keep and keeps(rt, m)
        self.parts = parts if parts is not None else [(m, head_lora(rt))]
        self.tiled = tiled(rt, [lora for _, lora in self.parts])
        if parts is not None and not self.tiled:
            raise ValueError("several runs share the head only on its tiled path")
        self.lora = self.parts[0][1]
        if self.tiled:
            self.weight = rt.model.get_output_embeddings().weight  # [V, H]
            self.blocks = self._gemm_blocks()
            self.tiles = tiles(vocab)
            with torch.no_grad():
                done = [self._block_forward(span, runs) for span, runs in self.blocks]
            self.kept = [tiles for _, _, tiles, _ in done] if self.keep else None
            self.lse = [lse for _, lse, _, _ in done]
            self.maxes = [maxes for _, _, _, maxes in done]
            self.logprobs = torch.cat([lp for lp, _, _, _ in done] + [self._empty()])
        else:
            rows = chunk_rows(vocab)
            self.blocks = [slice(i, min(i + rows, m)) for i in range(0, m, rows)]
            self.kept = [self._chunk_graph(c) for c in self.blocks] if self.keep else None
            with torch.no_grad():
                self.logprobs = torch.cat([lp.detach() for _, lp in self.kept] if self.kept else
                                          [_logprobs(rt, hidden[c], targets[c]) for c in self.blocks] + [self._empty()])

    def backward(self, g_lp: torch.Tensor, head_params: list[torch.Tensor]) -> tuple[torch.Tensor, list]:
        """(d loss / d hidden [M, H], the grads of `head_params`: this run's LoRA on the head, or none)."""
        if not self.tiled:
            g_hidden = torch.empty_like(self.hidden)
            return g_hidden, self._autograd_backward(g_lp, head_params, g_hidden)
        g_hidden, (got,) = self.backward_parts(g_lp)
        grads = {}
        if got is not None:
            grads = {id(self.lora[0]): got[0], id(self.lora[1]): got[1]}
        return g_hidden, [grads.get(id(p)) for p in head_params]

    def backward_parts(self, g_lp: torch.Tensor) -> tuple[torch.Tensor, list]:
        """(d loss / d hidden [M, H], per part (grad A, grad B) of its head LoRA or None); tiled path."""
        g_hidden = torch.empty_like(self.hidden)
        grads: list[list | None] = [None] * len(self.parts)
        with torch.no_grad():
            for k, (span, runs) in enumerate(self.blocks):
                got = self._block_backward(k, span, runs, g_lp[span], g_hidden[span])
                for blk, pair in zip(runs, got):
                    if pair is None:
                        continue
                    if grads[blk.part] is None:  # a run's blocks summed in order, as alone
                        grads[blk.part] = list(pair)
                    else:
                        grads[blk.part][0].add_(pair[0])
                        grads[blk.part][1].add_(pair[1])
        return g_hidden, [None if g is None else tuple(g) for g in grads]

    def _empty(self) -> torch.Tensor:
        return self.hidden.new_zeros((0, *self.targets.shape[1:]), dtype=torch.float32)

    # -- tiled

    def _gemm_blocks(self) -> list[tuple[slice, list[_Block]]]:
        """(rows of `hidden`, the runs' blocks in them) per head GEMM, as `packing` lays them out."""
        out: list[tuple[slice, list[_Block]]] = []
        start = 0
        for packed in packing([m for m, _ in self.parts]):
            blocks, at = [], 0
            for k, n in packed:
                blocks.append(_Block(slice(at, at + n), k, self.parts[k][1]))
                at += n
            out.append((slice(start, start + at), blocks))
            start += at
        return out

    def _block_forward(self, span: slice, runs: list[_Block]):
        """(logprobs, per run block its logsumexp [R_b], the tiles, per tile the blocks' row maxima)
        of one GEMM's rows. A tile leaves holding exp(logit - its row's max in the tile) (_exp_rows),
        which the backward scales into the softmax instead of exponentiating again. Only the GEMMs
        span the runs' blocks: the rest runs block by block, on the shapes the run alone has (a
        vectorised exp or log rounds a tensor's last few elements another way, so a row's bits would
        otherwise depend on how many rows share its tensor)."""
        x, targets = self.hidden[span], self.targets[span]
        xs = [self._lora_rows(x[blk.at], blk.lora) for blk in runs]
        lses: list[list[torch.Tensor]] = [[] for _ in runs]
        tiles, maxes = [], []
        # [R, K] like `inside`: shaped [R] it would broadcast to [R, R] (and to [0, 0] for a rank
        # without datums, engine/sharding.py, whose lp[:, 0] then fails).
        picked = torch.zeros((targets.shape[0], targets.shape[1] if targets.dim() == 2 else 1), dtype=torch.float32,
                             device=x.device)
        for tile in self.tiles:
            z = self._logits(x, runs, xs, tile)
            index, inside = self._local(targets, tile)
            picked = torch.where(inside, z.gather(-1, index), picked)  # before z turns into exponentials
            row_max = []
            for blk, out in zip(runs, lses):
                m, lse = _exp_rows(z[blk.at])
                out.append(lse[:, 0])
                row_max.append(m)
            maxes.append(row_max)
            if self.keep:
                tiles.append(z)
        lse = [got[0] if len(got) == 1 else torch.logsumexp(torch.stack(got), dim=0) for got in lses]
        lp = torch.cat([picked[blk.at] - b[:, None] for blk, b in zip(runs, lse)])  # [R, K]
        return (lp if targets.dim() == 2 else lp[:, 0]), lse, tiles, maxes

    def _block_backward(self, k: int, span: slice, runs: list[_Block], g: torch.Tensor, g_x: torch.Tensor):
        """d loss / d logits tile by tile, into d hidden of the GEMM's rows (g_x) and, per run block
        with a LoRA on the head, (grad A, grad B) of that block (None without one)."""
        x, targets = self.hidden[span], self.targets[span]
        xs = [self._lora_rows(x[blk.at], blk.lora) for blk in runs]
        g2 = g if g.dim() == 2 else g[:, None]
        totals = [g2[blk.at].sum(-1, keepdim=True).neg() for blk in runs]  # d lse: every target's logprob has -lse
        q: list = [None] * len(runs)  # per block: d loss / d xs [R, r]
        # Per block: d loss / d B, made tile by tile either as d^T @ xs straight into B's layout
        # [V, r], or as xs^T @ d into [r, V] and transposed once at the end (direct_b_grad says
        # which). The two give the same bits on this CPU (every block size measured); which is
        # faster depends on the block's rows and the threads.
        rows = [blk.at.stop - blk.at.start for blk in runs]
        onednn = [gemm.lora_on_onednn(x, n, LORA_MIN_ROWS) for n in rows]
        direct = [not fast and direct_b_grad(n) for n, fast in zip(rows, onednn)]
        g_b = [None if blk.lora is None else blk.lora[1].new_empty(blk.lora[1].shape[::1 if way else -1])
               for blk, way in zip(runs, direct)]
        for t, tile in enumerate(self.tiles):
            if self.kept is not None:
                d = self.kept[k][t]
            else:  # the forward's exponentials again: the same GEMMs, maxima and kernels
                d = self._logits(x, runs, xs, tile)
                for blk, m in zip(runs, self.maxes[k][t]):
                    d[blk.at].sub_(m).exp_()
            for blk, lse, total, m in zip(runs, self.lse[k], totals, self.maxes[k][t]):
                d[blk.at].mul_(_softmax_scale(m, lse[:, None], total))  # -sum(g) * softmax, in place
            index, inside = self._local(targets, tile)
            d.scatter_add_(-1, index, torch.where(inside, g2, 0.0))
            w = self.weight[tile]
            gemm.add_input_grad(g_x, d, w, first=t == 0)
            for i, blk in enumerate(runs):
                if blk.lora is None:
                    continue
                b, d_blk = blk.lora[1], d[blk.at]
                if q[i] is None:
                    q[i] = gemm.lora_mm(d_blk, b[tile], rows[i], LORA_MIN_ROWS)
                else:
                    gemm.add_lora(q[i], d_blk, b[tile], 1.0, rows[i], LORA_MIN_ROWS)
                if onednn[i]:
                    g_b[i][:, tile].copy_(gemm.lora_mm(xs[i].t(), d_blk, rows[i], LORA_MIN_ROWS))
                elif direct[i]:
                    torch.mm(d_blk.t(), xs[i], out=g_b[i][tile])
                else:
                    torch.mm(xs[i].t(), d_blk, out=g_b[i][:, tile])
            if self.kept is not None:
                self.kept[k][t] = None  # freed as it goes
        out = []
        for i, blk in enumerate(runs):
            if blk.lora is None:
                out.append(None)
                continue
            a, _, scaling = blk.lora
            g_u = q[i] if scaling == 1.0 else q[i] * scaling  # xs = (x @ A^T) * scaling
            g_x[blk.at].addmm_(g_u, a)
            out.append((g_u.t() @ x[blk.at], g_b[i] if direct[i] else g_b[i].t().contiguous()))
        return out

    @staticmethod
    def _lora_rows(x: torch.Tensor, lora) -> torch.Tensor | None:
        """x @ A^T * scaling [R, r] for a head LoRA (None without one)."""
        if lora is None:
            return None
        a, _, scaling = lora
        u = x @ a.t()
        return u if scaling == 1.0 else u * scaling

    def _logits(self, x: torch.Tensor, runs: list[_Block], xs: list, tile: slice) -> torch.Tensor:
        z = gemm.linear(x, self.weight[tile])
        for blk, u in zip(runs, xs):
            if u is not None:
                gemm.add_lora(z[blk.at], u, blk.lora[1][tile].t(), 1.0, blk.at.stop - blk.at.start, LORA_MIN_ROWS)
        return z

    @staticmethod
    def _local(targets: torch.Tensor, tile: slice) -> tuple[torch.Tensor, torch.Tensor]:
        """(targets as column indices into the tile, clamped; which of them fall inside it), [R, K]."""
        t = targets if targets.dim() == 2 else targets[:, None]
        local = t - tile.start
        inside = (local >= 0) & (local < tile.stop - tile.start)
        return local.clamp(0, tile.stop - tile.start - 1), inside

    # -- autograd

    def _chunk_graph(self, c: slice):
        """(the chunk's hidden as a leaf, its logprobs with their graph back to it and the head's LoRA)."""
        h_c = self.hidden[c].detach().requires_grad_(True)
        with torch.enable_grad():
            return h_c, _logprobs(self.rt, h_c, self.targets[c])

    def _autograd_backward(self, g_lp: torch.Tensor, head_params: list[torch.Tensor], g_hidden: torch.Tensor) -> list:
        head_grads: list[torch.Tensor | None] = [None] * len(head_params)
        for k, c in enumerate(self.blocks):
            h_c, lp_c = self.kept[k] if self.kept else self._chunk_graph(c)
            got = torch.autograd.grad(lp_c, [h_c, *head_params], grad_outputs=g_lp[c], allow_unused=True)
            g_hidden[c] = got[0]
            for i, g in enumerate(got[1:]):
                if g is not None:
                    head_grads[i] = g if head_grads[i] is None else head_grads[i] + g
        return head_grads


def _exp_rows(z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """z [R, W] -> exp(z - m) in place, m [R, 1] each row's max (0 where that is infinite), as
    torch.logsumexp subtracts it; returns (m, the rows' logsumexp [R, 1], torch's sequence and bits).
    The backward's softmax is then z times _softmax_scale: one scaling pass where exp(z - lse) took a
    subtraction and an exp."""
    m = z.amax(-1, keepdim=True)
    m.masked_fill_(m.abs() == float("inf"), 0.0)
    z.sub_(m).exp_()
    return m, z.sum(-1, keepdim=True).log_().add_(m)


def _softmax_scale(m: torch.Tensor, lse: torch.Tensor, total: torch.Tensor) -> torch.Tensor:
    """[R, 1]: what turns _exp_rows' exp(z - m) into total * softmax (lse over the whole row)."""
    return (m - lse).exp_().mul_(total)


def _logprobs(rt: "ModelRuntime", hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """logit[target] - logsumexp(logits) for one chunk of rows, through the head module: [C] or [C, K]."""
    logits = rt.model.get_output_embeddings()(hidden)  # [C, V]
    softcap = getattr(rt.model.config, "final_logit_softcapping", None)
    if softcap:  # Gemma-style models cap logits in their forward; keep parity with it
        logits = torch.tanh(logits / softcap) * softcap
    return TargetLogprobs.apply(logits, targets)


class TargetLogprobs(torch.autograd.Function):
    """logits [C, V] (any float dtype), targets [C] or [C, K] -> logit[target] - logsumexp(logits),
    fp32. bf16 logits are upcast first, as HF's causal-LM loss does (engine/precision.py): summed in
    bf16 over a 49k vocab the logsumexp is off by up to ~0.03. The logsumexp is torch's sequence
    (row max, exp of the difference, sum, log, plus the max), made in place on the fp32 copy, which
    keeps the exponentials for the backward: d logits = g at the targets - sum(g) * softmax, the
    softmax one scaling of them (as the tiled path does). Through autograd the backward made the
    softmax again (a subtraction and an exp over [C, V]), a zero [C, V] for the gather's gradient and
    their sum: SmolLM2 in bf16, 2 x 256 tokens, 1 thread, ~70 ms of a ~1,200 ms step."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        z = logits.float() if logits.dtype != torch.float32 else logits.clone()  # ours to overwrite
        t = targets if targets.dim() == 2 else targets[:, None]
        picked = z.gather(-1, t)  # before z turns into exponentials
        m, lse = _exp_rows(z)
        ctx.save_for_backward(z, m, lse, t)
        ctx.dtype, ctx.soft = logits.dtype, targets.dim() == 2
        lp = picked - lse
        return lp if ctx.soft else lp[:, 0]

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        e, m, lse, t = ctx.saved_tensors
        g2 = g if ctx.soft else g[:, None]
        d = e * _softmax_scale(m, lse, g2.sum(-1, keepdim=True).neg())  # -sum(g) * softmax
        d.scatter_add_(-1, t, g2.to(d.dtype))
        return d.to(ctx.dtype), None
