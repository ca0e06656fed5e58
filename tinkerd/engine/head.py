"""The unembedding (LM head) of one run's rows: target logprobs, then their backward.

Every Tinker loss is a function of the target logprobs alone (engine/training.py), so the head is
a pass of its own: `HeadPass(rt, hidden, targets)` gives logprob[target] - logsumexp(logits) per
position, and `backward(g)` turns d loss / d logprobs into d loss / d hidden plus the grads of the
head's own LoRA. The [M, V] logits are the biggest tensor of a step (SmolLM2, 512 positions: 100 MB
and 58 of its ~330 GFLOP), so how they are cut matters:

- Tiled (a plain fp32 head, with or without this run's LoRA on it): rows in blocks of ROW_BLOCK,
  the vocabulary in tiles of about TILE_CELLS cells per block, the logsumexp combined across tiles,
  and the backward written out (d logits = g * (onehot(target) - softmax), made in place in the
  kept tile, then one GEMM per tile into d hidden and the LoRA's grads). Whole-row GEMMs over a
  vocabulary tile run nearer the machine's rate than a few rows against the whole vocabulary
  (fp32, [512, 576] x [576, 8192] at 130 GFLOP/s on 2 threads, [128, 576] x [576, 49152] at 93),
  and the in-place softmax saves autograd's [M, V] temporaries. 512 positions of SmolLM2 through
  the head and back, median of 6: 1 thread 876 -> 783 ms, 1070 -> 876 with a rank-32 LoRA on the
  head (the SDK's default, train_unembed); 2 threads 581 -> 462 and 688 -> 516.
- Otherwise (a bf16 head, Gemma's logit softcap, a head with a bias): rows in chunks through
  autograd, the path HF's own forward takes, to the bit.

Several runs in one pass (engine/cotrain.py) share the head's GEMMs where their tiling agrees
(`share`): their rows are one block, each run's LoRA is added on its own rows, and each run's
d loss / d LoRA sums only its own rows. Every row's logits, logsumexp and d hidden are computed by
the same kernels on the same row as when its run is alone, so nothing moves by a bit (one thread,
as cotrain's body), while the [V, H] weight is streamed once per group instead of once per run: 8
runs of 64 tokens of SmolLM2 through the head and back took 910 ms run by run and 546 ms as one
block of 512 rows (2 threads).

Up to KEEP_CELLS logits are kept from the forward to the backward; beyond that each block is
recomputed in the backward, so memory holds one tile (or chunk) at a time. Keeping or recomputing
gives the same bits: the same kernels on the same inputs. The blocks depend only on the number of
rows, so a run's head gives the same bits alone and in a shared pass (engine/cotrain.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from tinkerd.engine.engine import ModelRuntime

# Up to this many [M, V] cells (256 MB fp32) the logits are kept rather than recomputed: the second
# head forward was 6% of a SmolLM2 step (2 x 256 tokens: 29 of ~330 GFLOP).
KEEP_CELLS = 1 << 26
# Tiled: rows per block, and logits cells per GEMM (16 MB fp32: the tile is still in cache when the
# logsumexp and, in the backward, the softmax pass over it run).
ROW_BLOCK = 512
TILE_CELLS = 1 << 22
MIN_TILE = 2048
# Autograd chunks: 2^22 cells each, but never fewer rows than this: the head's GEMMs run far below
# the machine's rate on a few rows (1 thread, 512 rows through the head and back: at 49k vocab
# 633 ms in 85-row chunks, 514 in 128; at 152k, 27-row chunks took 6.0 s against 3.4 s in 128).
CHUNK_MIN_ROWS = 128
# Most logits cells of one tile when several runs share it (`share`): 64 MB fp32.
GROUP_CELLS = 1 << 24

Lora = tuple[torch.Tensor, torch.Tensor, float]  # (A [r, H], B [V, r], scaling)


def head_lora(rt: "ModelRuntime", slot: int | None = None) -> Lora | None:
    """(A, B, scaling) of the LoRA an adapter slot (default: the routed run's) has on the
    unembedding, if it trains it."""
    head = rt.model.get_output_embeddings()
    if slot is None:
        slot = rt.ctx.groups[0].slot if rt.ctx.groups else None
    lw = getattr(head, "adapters", {}).get(slot) if slot is not None else None
    return (lw.a, lw.b, lw.scaling) if lw is not None else None


def _tiled(rt: "ModelRuntime", loras: list[Lora | None]) -> bool:
    head = rt.model.get_output_embeddings()
    base = getattr(head, "base", head)
    return (isinstance(base, torch.nn.Linear) and base.bias is None and base.weight.dtype == torch.float32
            and not getattr(rt.model.config, "final_logit_softcapping", None)
            and all(lora is None or lora[0].dtype == torch.float32 for lora in loras))


def _tile_width(rt: "ModelRuntime", rows: int) -> int:
    """Vocabulary columns per tile for a block of `rows` rows."""
    return min(rt.vocab_size, max(MIN_TILE, TILE_CELLS // rows))


def share(rt: "ModelRuntime", rows: list[int], loras: list[Lora | None], targets: list[torch.Tensor]) -> list[list[int]]:
    """Consecutive runs (by index) whose heads can run as one block: tiled, at most ROW_BLOCK rows
    each (one block alone too), the same tile width and target shape, GROUP_CELLS per tile at most."""
    groups: list[list[int]] = []
    key = None
    for i, (m, lora, t) in enumerate(zip(rows, loras, targets)):
        mine = (_tile_width(rt, m), tuple(t.shape[1:])) if 0 < m <= ROW_BLOCK and _tiled(rt, [lora]) else None
        if groups and mine is not None and mine == key and (sum(rows[j] for j in groups[-1]) + m) * mine[0] <= GROUP_CELLS:
            groups[-1].append(i)
        else:
            groups.append([i])
        key = mine
    return groups


class HeadPass:
    """The head over `hidden` [M, H] (detached from the body) for `targets` [M] or [M, K].

    `runs`: [(rows, LoRA or None)] of consecutive runs sharing the pass (cotrain's `share` groups,
    tiled only); default one run, the routed one (head_lora)."""

    def __init__(self, rt: "ModelRuntime", hidden: torch.Tensor, targets: torch.Tensor, keep: bool,
                 runs: list[tuple[int, Lora | None]] | None = None):
        self.rt, self.hidden, self.targets = rt, hidden, targets
        m, vocab = hidden.shape[0], rt.vocab_size
        self.runs = runs if runs is not None else [(m, head_lora(rt))]
        self.keep = keep and m * vocab <= KEEP_CELLS
        self.tiled = _tiled(rt, [lora for _, lora in self.runs])
        self.lora = self.runs[0][1]
        if self.tiled:
            self.weight = rt.model.get_output_embeddings().weight  # [V, H]
            rows = max(1, min(self.runs[0][0], ROW_BLOCK))  # one run's: its tiling alone
            if len(self.runs) == 1:  # blocks of ROW_BLOCK rows, all of the one run
                self.blocks = [(slice(i, min(i + rows, m)), [(slice(0, min(rows, m - i)), self.lora, 0)])
                               for i in range(0, m, rows)]
            else:  # one block, each run's rows a segment of it
                ends = [int(e) for e in torch.tensor([n for n, _ in self.runs]).cumsum(0)]
                self.blocks = [(slice(0, m), [(slice(e - n, e), lora, j)
                                              for j, ((n, lora), e) in enumerate(zip(self.runs, ends))])]
            width = _tile_width(rt, rows)
            self.tiles = [slice(j, min(j + width, vocab)) for j in range(0, vocab, width)]
            with torch.no_grad():
                done = [self._block_forward(b, segs) for b, segs in self.blocks]
            self.kept = [tiles for _, _, tiles in done] if self.keep else None
            self.lse = [lse for _, lse, _ in done]
            self.logprobs = torch.cat([lp for lp, _, _ in done] + [self._empty()])
        else:
            if len(self.runs) != 1:
                raise ValueError("runs share only a tiled head")
            rows = max(CHUNK_MIN_ROWS, TILE_CELLS // vocab)
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
        g_hidden, (grads,) = self.backward_runs(g_lp)
        by_id = {} if grads is None else {id(self.lora[0]): grads[0], id(self.lora[1]): grads[1]}
        return g_hidden, [by_id.get(id(p)) for p in head_params]

    def backward_runs(self, g_lp: torch.Tensor) -> tuple[torch.Tensor, list]:
        """Tiled: (d loss / d hidden [M, H], each run's (grad A, grad B) of its head LoRA, or None)."""
        g_hidden = torch.empty_like(self.hidden)
        grads: list = [None] * len(self.runs)
        with torch.no_grad():
            for k, (block, segs) in enumerate(self.blocks):
                for j, g_a, g_b in self._block_backward(k, block, segs, g_lp[block], g_hidden[block]):
                    if grads[j] is None:
                        grads[j] = (g_a, g_b)
                    else:
                        grads[j][0].add_(g_a)
                        grads[j][1].add_(g_b)
        return g_hidden, grads

    def _empty(self) -> torch.Tensor:
        return self.hidden.new_zeros((0, *self.targets.shape[1:]), dtype=torch.float32)

    # -- tiled

    def _block_forward(self, block: slice, segs: list):
        """(logprobs, logsumexp, the block's logit tiles) of one block of rows; `segs`: each run's
        (rows within the block, LoRA, run index)."""
        x, targets = self.hidden[block], self.targets[block]
        xs = [self._lora_rows(x[rows], lora) for rows, lora, _ in segs]
        lses, tiles = [], []
        picked = torch.zeros(targets.shape, dtype=torch.float32)
        for tile in self.tiles:
            z = self._logits(x, xs, segs, tile)
            lses.append(torch.logsumexp(z, dim=-1))
            index, inside = self._local(targets, tile)
            picked = torch.where(inside, z.gather(-1, index), picked)
            if self.keep:
                tiles.append(z)
        lse = lses[0] if len(lses) == 1 else torch.logsumexp(torch.stack(lses), dim=0)
        return (picked if targets.dim() == 2 else picked[:, 0]) - (lse[:, None] if targets.dim() == 2 else lse), lse, tiles

    def _block_backward(self, k: int, block: slice, segs: list, g: torch.Tensor, g_x: torch.Tensor) -> list:
        """d loss / d logits tile by tile, into d hidden of the block (g_x); returns (run index,
        grad A, grad B) of each of its runs with a LoRA on the head, from that run's rows only."""
        x, targets, lse = self.hidden[block], self.targets[block], self.lse[k]
        xs = [self._lora_rows(x[rows], lora) for rows, lora, _ in segs]
        g2 = g if g.dim() == 2 else g[:, None]
        total = g2.sum(-1, keepdim=True)  # d lse: every target's logprob has -lse
        q: list = [None] * len(segs)  # d loss / d xs [R_j, r] of each run
        g_b: list = [None] * len(segs)
        for t, tile in enumerate(self.tiles):
            z = self.kept[k][t] if self.kept is not None else self._logits(x, xs, segs, tile)
            d = z.sub_(lse[:, None]).exp_().mul_(total.neg())  # -sum(g) * softmax, in place
            index, inside = self._local(targets, tile)
            d.scatter_add_(-1, index, torch.where(inside, g2, 0.0))
            w = self.weight[tile]
            if t == 0:
                torch.mm(d, w, out=g_x)
            else:
                g_x.addmm_(d, w)
            for j, ((rows, lora, _), u) in enumerate(zip(segs, xs)):
                if u is None:
                    continue
                b, dr = lora[1], d[rows]
                q[j] = dr @ b[tile] if q[j] is None else q[j].addmm_(dr, b[tile])
                g_b[j] = torch.empty_like(b) if g_b[j] is None else g_b[j]
                torch.mm(dr.t(), u, out=g_b[j][tile])
            if self.kept is not None:
                self.kept[k][t] = None  # freed as it goes
        out = []
        for j, ((rows, lora, run), u) in enumerate(zip(segs, xs)):
            if u is None:
                continue
            a, _, scaling = lora
            g_u = q[j] if scaling == 1.0 else q[j] * scaling  # xs = (x @ A^T) * scaling
            g_x[rows].addmm_(g_u, a)
            out.append((run, g_u.t() @ x[rows], g_b[j]))
        return out

    @staticmethod
    def _lora_rows(x: torch.Tensor, lora: Lora | None) -> torch.Tensor | None:
        """x @ A^T * scaling [R, r] for a head LoRA (None without one)."""
        if lora is None:
            return None
        a, _, scaling = lora
        u = x @ a.t()
        return u if scaling == 1.0 else u * scaling

    def _logits(self, x: torch.Tensor, xs: list, segs: list, tile: slice) -> torch.Tensor:
        z = x @ self.weight[tile].t()
        for (rows, lora, _), u in zip(segs, xs):
            if u is not None:
                z[rows].addmm_(u, lora[1][tile].t())
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


def _logprobs(rt: "ModelRuntime", hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """logit[target] - logsumexp(logits) for one chunk of rows, through the head module: [C] or [C, K]."""
    logits = rt.model.get_output_embeddings()(hidden)  # [C, V]
    softcap = getattr(rt.model.config, "final_logit_softcapping", None)
    if softcap:  # Gemma-style models cap logits in their forward; keep parity with it
        logits = torch.tanh(logits / softcap) * softcap
    # bf16 logits are upcast before the logsumexp, as HF's causal-LM loss does (engine/precision.py):
    # summed in bf16 over a 49k vocab it is off by up to ~0.03. A no-op in fp32.
    logits = logits.float()
    lse = torch.logsumexp(logits, dim=-1)  # [C]
    if targets.dim() == 1:
        return logits.gather(-1, targets[:, None])[:, 0] - lse
    return logits.gather(-1, targets) - lse[:, None]
