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


def head_lora(rt: "ModelRuntime") -> tuple[torch.Tensor, torch.Tensor, float] | None:
    """(A, B, scaling) of the LoRA the routed run has on the unembedding, if it trains it."""
    head = rt.model.get_output_embeddings()
    lw = getattr(head, "adapters", {}).get(rt.ctx.groups[0].slot) if rt.ctx.groups else None
    return (lw.a, lw.b, lw.scaling) if lw is not None else None


def _tiled(rt: "ModelRuntime") -> bool:
    head = rt.model.get_output_embeddings()
    base = getattr(head, "base", head)
    lora = head_lora(rt)
    return (isinstance(base, torch.nn.Linear) and base.bias is None and base.weight.dtype == torch.float32
            and not getattr(rt.model.config, "final_logit_softcapping", None)
            and (lora is None or lora[0].dtype == torch.float32))


class HeadPass:
    """The head over `hidden` [M, H] (detached from the body) for `targets` [M] or [M, K]."""

    def __init__(self, rt: "ModelRuntime", hidden: torch.Tensor, targets: torch.Tensor, keep: bool):
        self.rt, self.hidden, self.targets = rt, hidden, targets
        m, vocab = hidden.shape[0], rt.vocab_size
        self.keep = keep and m * vocab <= KEEP_CELLS
        self.tiled = _tiled(rt)
        self.lora = head_lora(rt)
        if self.tiled:
            self.weight = rt.model.get_output_embeddings().weight  # [V, H]
            rows = max(1, min(m, ROW_BLOCK))
            self.blocks = [slice(i, min(i + rows, m)) for i in range(0, m, rows)]
            width = min(vocab, max(MIN_TILE, TILE_CELLS // rows))
            self.tiles = [slice(j, min(j + width, vocab)) for j in range(0, vocab, width)]
            with torch.no_grad():
                done = [self._block_forward(b) for b in self.blocks]
            self.kept = [tiles for _, _, tiles in done] if self.keep else None
            self.lse = [lse for _, lse, _ in done]
            self.logprobs = torch.cat([lp for lp, _, _ in done] + [self._empty()])
        else:
            rows = max(CHUNK_MIN_ROWS, TILE_CELLS // vocab)
            self.blocks = [slice(i, min(i + rows, m)) for i in range(0, m, rows)]
            self.kept = [self._chunk_graph(c) for c in self.blocks] if self.keep else None
            with torch.no_grad():
                self.logprobs = torch.cat([lp.detach() for _, lp in self.kept] if self.kept else
                                          [_logprobs(rt, hidden[c], targets[c]) for c in self.blocks] + [self._empty()])

    def backward(self, g_lp: torch.Tensor, head_params: list[torch.Tensor]) -> tuple[torch.Tensor, list]:
        """(d loss / d hidden [M, H], the grads of `head_params`: this run's LoRA on the head, or none)."""
        g_hidden = torch.empty_like(self.hidden)
        if not self.tiled:
            return g_hidden, self._autograd_backward(g_lp, head_params, g_hidden)
        g_a = g_b = None
        with torch.no_grad():
            for k, block in enumerate(self.blocks):
                got = self._block_backward(k, block, g_lp[block], g_hidden[block])
                if got is not None:
                    g_a = got[0] if g_a is None else g_a.add_(got[0])
                    g_b = got[1] if g_b is None else g_b.add_(got[1])
        grads = {}
        if self.lora is not None:
            grads = {id(self.lora[0]): g_a, id(self.lora[1]): g_b}
        return g_hidden, [grads.get(id(p)) for p in head_params]

    def _empty(self) -> torch.Tensor:
        return self.hidden.new_zeros((0, *self.targets.shape[1:]), dtype=torch.float32)

    # -- tiled

    def _block_forward(self, block: slice):
        """(logprobs, logsumexp, the block's logit tiles) of one block of rows."""
        x, targets = self.hidden[block], self.targets[block]
        xs = self._lora_rows(x)
        lses, tiles = [], []
        picked = torch.zeros(targets.shape, dtype=torch.float32)
        for tile in self.tiles:
            z = self._logits(x, xs, tile)
            lses.append(torch.logsumexp(z, dim=-1))
            index, inside = self._local(targets, tile)
            picked = torch.where(inside, z.gather(-1, index), picked)
            if self.keep:
                tiles.append(z)
        lse = lses[0] if len(lses) == 1 else torch.logsumexp(torch.stack(lses), dim=0)
        return (picked if targets.dim() == 2 else picked[:, 0]) - (lse[:, None] if targets.dim() == 2 else lse), lse, tiles

    def _block_backward(self, k: int, block: slice, g: torch.Tensor, g_x: torch.Tensor):
        """d loss / d logits tile by tile, into d hidden of the block (g_x) and, with a LoRA on the
        head, (grad A, grad B) of the block."""
        x, targets, lse = self.hidden[block], self.targets[block], self.lse[k]
        xs = self._lora_rows(x)
        g2 = g if g.dim() == 2 else g[:, None]
        total = g2.sum(-1, keepdim=True)  # d lse: every target's logprob has -lse
        q = g_b = None
        for t, tile in enumerate(self.tiles):
            z = self.kept[k][t] if self.kept is not None else self._logits(x, xs, tile)
            d = z.sub_(lse[:, None]).exp_().mul_(total.neg())  # -sum(g) * softmax, in place
            index, inside = self._local(targets, tile)
            d.scatter_add_(-1, index, torch.where(inside, g2, 0.0))
            w = self.weight[tile]
            if t == 0:
                torch.mm(d, w, out=g_x)
            else:
                g_x.addmm_(d, w)
            if xs is not None:
                a, b, _ = self.lora
                q = d @ b[tile] if q is None else q.addmm_(d, b[tile])  # d loss / d xs [R, r]
                g_b = torch.empty_like(b) if g_b is None else g_b
                torch.mm(d.t(), xs, out=g_b[tile])
            if self.kept is not None:
                self.kept[k][t] = None  # freed as it goes
        if xs is None:
            return None
        a, _, scaling = self.lora
        g_u = q if scaling == 1.0 else q * scaling  # xs = (x @ A^T) * scaling
        g_x.addmm_(g_u, a)
        return g_u.t() @ x, g_b

    def _lora_rows(self, x: torch.Tensor) -> torch.Tensor | None:
        """x @ A^T * scaling [R, r] for the head's LoRA (None without one)."""
        if self.lora is None:
            return None
        a, _, scaling = self.lora
        u = x @ a.t()
        return u if scaling == 1.0 else u * scaling

    def _logits(self, x: torch.Tensor, xs: torch.Tensor | None, tile: slice) -> torch.Tensor:
        z = x @ self.weight[tile].t()
        return z if xs is None else z.addmm_(xs, self.lora[1][tile].t())

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
