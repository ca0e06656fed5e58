"""Sampling rules: request validation, per-row token choice (temperature, top-k, top-p), stops.

Everything here works on a batch of rows that may come from different requests (a later scheduler
fuses many requests into one decode batch), so each row carries its own temperature, top-k, top-p,
random stream and stop rule. Shapes: B rows, V vocab, K candidates.
"""

from __future__ import annotations

import hashlib
import math
import secrets
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from tinkerd.errors import UserError
from tinkerd.types import SampleOp

# Logprob written into empty top-k cells; the SDK turns a row whose first cell has it into None.
EMPTY_LOGPROB = -99999.0

# (id, logprob) pairs of top-k prompt or sample logprobs one request may ask for. The result crosses
# the engine pipe, is stored and is sent as JSON (~30 B a pair): 2^20 pairs are ~30 MB, and cover
# top-256 over a 4k-token prompt. K up to the vocabulary over a long prompt would be gigabytes.
MAX_TOPK_PAIRS = 1 << 20

# Temperatures below this are greedy (vLLM's cut-off too): logits / 1e-320 overflow to inf and the
# softmax would be NaN, and below 1e-5 sampling is argmax anyway for any realistic logit gap.
_GREEDY_BELOW = 1e-5

# First candidate count tried for a top-p row without top-k; grown x8 until the candidates hold
# top_p of the mass. A full sort of Qwen3's 151,669 logits costs ~40 ms per row on 2 CPU cores,
# torch.topk(256) ~1 ms, and a peaked model's nucleus is almost always far smaller than 256.
_NUCLEUS_FIRST_K = 256


def validate(op: SampleOp, vocab_size: int, max_context_length: int) -> None:
    """Reject a request we will never serve, before any engine state is touched."""
    prompt = op.prompt
    if not isinstance(prompt, np.ndarray) or prompt.ndim != 1 or not np.issubdtype(prompt.dtype, np.integer):
        raise UserError("prompt must be a 1-D array of integer token ids")
    if prompt.size == 0:
        raise UserError("prompt is empty: sampling needs at least one token")
    lo, hi = int(prompt.min()), int(prompt.max())
    if lo < 0 or hi >= vocab_size:
        bad = lo if lo < 0 else hi
        raise UserError(f"prompt token id {bad} is outside the vocabulary [0, {vocab_size})")
    if op.num_samples < 1:
        raise UserError(f"num_samples must be >= 1, got {op.num_samples}")
    p = op.params
    if p.max_tokens < 1:
        raise UserError(f"max_tokens must be >= 1, got {p.max_tokens}")
    if prompt.size + p.max_tokens > max_context_length:
        raise UserError(
            f"prompt ({prompt.size} tokens) + max_tokens ({p.max_tokens}) exceeds the model's context "
            f"length of {max_context_length}"
        )
    if not math.isfinite(p.temperature) or p.temperature < 0:
        raise UserError(f"temperature must be a finite number >= 0, got {p.temperature}")
    # top_k: -1 is the protocol's "off"; 0 is also "off" (vLLM's and HF's convention), so a client
    # written against either does not get an error for a value that means nothing else.
    if p.top_k < -1:
        raise UserError(f"top_k must be -1 (off), 0 (off) or a positive count, got {p.top_k}")
    if not 0.0 < p.top_p <= 1.0:  # also rejects NaN
        raise UserError(f"top_p must be in (0, 1], got {p.top_p}")
    if any(len(seq) == 0 for seq in p.stop_token_seqs):
        raise UserError("a stop token sequence is empty")
    if any(s == "" for s in p.stop_strings):
        raise UserError("a stop string is empty")
    if op.topk_prompt_logprobs < 0 or op.topk_prompt_logprobs > vocab_size:
        raise UserError(f"topk_prompt_logprobs must be in [0, {vocab_size}], got {op.topk_prompt_logprobs}")
    if op.topk_sample_logprobs < 0 or op.topk_sample_logprobs > vocab_size:
        raise UserError(f"topk_sample_logprobs must be in [0, {vocab_size}], got {op.topk_sample_logprobs}")
    # N >= len(prompt) is accepted and scores every position that can be scored (all but the first).
    if op.prompt_logprobs_last_n is not None and op.prompt_logprobs_last_n < 1:
        raise UserError(f"prompt_logprobs_last_n must be >= 1, got {op.prompt_logprobs_last_n}")
    scored = prompt.size - 1 if op.prompt_logprobs_last_n is None else min(op.prompt_logprobs_last_n, prompt.size - 1)
    if op.topk_prompt_logprobs * scored > MAX_TOPK_PAIRS:
        raise UserError(f"topk_prompt_logprobs={op.topk_prompt_logprobs} over {scored} prompt positions is "
                        f"{op.topk_prompt_logprobs * scored} (id, logprob) pairs, more than {MAX_TOPK_PAIRS} per "
                        f"request: lower K, or score fewer positions (prompt_logprobs_last_n)")
    sampled = op.num_samples * p.max_tokens
    if op.topk_sample_logprobs * sampled > MAX_TOPK_PAIRS:
        raise UserError(f"topk_sample_logprobs={op.topk_sample_logprobs} over up to {sampled} sampled tokens is more "
                        f"than {MAX_TOPK_PAIRS} (id, logprob) pairs per request: lower K, max_tokens or num_samples")


def row_generators(seed: int | None, n_rows: int) -> list[torch.Generator]:
    """One random stream per row, derived from (seed, row index).

    Per-row streams keep a row's tokens independent of which other rows share its decode batch
    (rows finishing early, or other requests fused in later), so the same seed always gives the same
    completions; without a seed the base is fresh randomness.
    """
    base = seed if seed is not None else secrets.randbits(64)
    gens = []
    for row in range(n_rows):
        digest = hashlib.blake2b(f"{base}:{row}".encode(), digest_size=8).digest()
        gens.append(torch.Generator().manual_seed(int.from_bytes(digest, "little")))
    return gens


@dataclass
class RowRules:
    """The token-choice settings of each row of a decode batch."""

    temperature: torch.Tensor  # [B] float64; 0 (or < 1e-5) = greedy
    top_k: torch.Tensor  # [B] int64; <= 0 = off
    top_p: torch.Tensor  # [B] float64; 1 = off
    generators: list[torch.Generator]  # [B]

    @staticmethod
    def repeat(temperature: float, top_k: int, top_p: float, generators: list[torch.Generator]) -> RowRules:
        n = len(generators)
        return RowRules(
            torch.full((n,), float(temperature), dtype=torch.float64),
            torch.full((n,), int(top_k), dtype=torch.long),
            torch.full((n,), float(top_p), dtype=torch.float64),
            generators,
        )

    def select(self, rows: list[int]) -> RowRules:
        idx = torch.tensor(rows, dtype=torch.long)
        return RowRules(self.temperature[idx], self.top_k[idx], self.top_p[idx], [self.generators[i] for i in rows])

    @staticmethod
    def stack(rules: list[RowRules]) -> RowRules:
        """One RowRules for the rows of several (a decode batch fusing many requests)."""
        return RowRules(
            torch.cat([r.temperature for r in rules]),
            torch.cat([r.top_k for r in rules]),
            torch.cat([r.top_p for r in rules]),
            [g for r in rules for g in r.generators],
        )


def choose_tokens(logits: torch.Tensor, rules: RowRules) -> torch.Tensor:
    """Pick one token per row from raw logits [B, V]; returns [B] int64."""
    chosen = greedy_tokens(logits)  # [B]: the greedy answer, overwritten for sampled rows
    sampled = (rules.temperature >= _GREEDY_BELOW).nonzero().flatten().tolist()
    if not sampled:
        return chosen
    vocab = logits.shape[-1]
    top_k = rules.top_k.clamp(max=vocab)
    truncated = [i for i in sampled if 0 < top_k[i] < vocab or rules.top_p[i] < 1.0]
    plain = [i for i in sampled if i not in set(truncated)]
    # One uniform draw per sampled row per step, from that row's own stream.
    u = {i: torch.rand((), generator=rules.generators[i], dtype=torch.float64).item() for i in sampled}
    if plain:
        idx = torch.tensor(plain)
        scaled = (logits if len(plain) == logits.shape[0] else logits[idx]).to(torch.float64, copy=True)  # [b, V]
        temperature = rules.temperature[idx]
        if not bool((temperature == 1.0).all()):  # x / 1.0 is x: skip the pass (~5 ms at 32 x 49k)
            scaled.div_(temperature[:, None])
        # Unnormalised exp(x - max): the inverse CDF scales its target by the row's total, so the
        # softmax's division would be one more pass over [b, V] for nothing.
        weights = scaled.sub_(scaled.amax(dim=-1, keepdim=True)).exp_()
        chosen[idx] = _inverse_cdf(weights, torch.tensor([u[i] for i in plain], dtype=torch.float64))
    if truncated:
        idx = torch.tensor(truncated)
        cand_ids, probs = _truncated_probs(logits[idx], rules.temperature[idx], top_k[idx], rules.top_p[idx])
        pick = _inverse_cdf(probs, torch.tensor([u[i] for i in truncated], dtype=torch.float64))  # [b]
        chosen[idx] = cand_ids.gather(1, pick[:, None]).squeeze(1)
    return chosen


def greedy_tokens(logits: torch.Tensor, block: int = 1024) -> torch.Tensor:
    """logits.argmax(dim=-1) of [B, V] logits (the first index of each row's maximum, NaN counting
    as the largest), through the maxima of blocks of `block` columns.

    On one thread torch's argmax over 8 x 49k fp32 takes 0.33-0.48 ms, a vectorised amax 0.02: the
    first block holding the row's maximum is found among the block maxima, then argmax runs
    inside that block only (~0.05 ms in all).
    """
    rows, vocab = logits.shape
    whole = vocab // block
    if whole < 2:
        return logits.argmax(dim=-1)
    blocks = logits[:, : whole * block].view(rows, whole, block)
    maxima = blocks.amax(dim=-1)  # [B, n]
    if whole * block < vocab:  # the ragged end as one more (shorter) block
        maxima = torch.cat((maxima, logits[:, whole * block :].amax(dim=-1, keepdim=True)), dim=1)
    first = maxima.argmax(dim=-1)  # [B]: the first block holding the maximum (argmax is first-wins)
    starts = first * block
    span = torch.arange(block, device=logits.device) + starts[:, None]  # [B, block]
    inside = logits.gather(1, span.clamp_(max=vocab - 1))  # a clamped ragged block repeats its last column
    return starts + inside.argmax(dim=-1)


def _inverse_cdf(probs: torch.Tensor, u: torch.Tensor, block: int = 1024) -> torch.Tensor:
    """Sample column indices of probs [b, K] (rows need not sum to 1) with uniforms u [b] in [0, 1).

    The target is (1 - u) * total, which lies in (0, total]; searching for the first cdf >= target
    then can never land on a zero-probability cell, at the start, middle or end of the row.

    Over a vocabulary, in two levels: the block of `block` columns where the cdf of block sums
    reaches the target, then the column inside it. A cumsum is sequential per row (~7 ms at 32 x
    49k float64 on one core); the block sums are one vectorised pass, and only one block per row is
    then summed in order. The two levels round differently from one long cumsum, which moves a
    choice only for a target within ~1e-16 of the total from a cell boundary.
    """
    rows, width = probs.shape
    whole = width // block
    if whole < 2:
        cdf = probs.cumsum(dim=-1)  # [b, K] float64: 151k summands keep ~1e-12 accuracy
        target = (1.0 - u) * cdf[:, -1]
        return torch.searchsorted(cdf, target[:, None], right=False).squeeze(1).clamp(max=width - 1)
    sums = probs[:, : whole * block].view(rows, whole, block).sum(dim=-1)  # [b, n]
    if whole * block < width:  # the ragged end as one more (shorter) block
        sums = torch.cat((sums, probs[:, whole * block :].sum(dim=-1, keepdim=True)), dim=1)
    block_cdf = sums.cumsum(dim=-1)  # [b, n]
    target = (1.0 - u) * block_cdf[:, -1]  # [b]
    k = torch.searchsorted(block_cdf, target[:, None]).squeeze(1).clamp(max=block_cdf.shape[1] - 1)  # [b]
    before = torch.where(k > 0, block_cdf.gather(1, (k - 1).clamp(min=0)[:, None]).squeeze(1), 0.0)  # [b]
    starts = k * block
    span = torch.arange(block)[None, :] + starts[:, None]  # [b, block]
    inside = probs.gather(1, span.clamp(max=width - 1)).masked_fill_(span >= width, 0.0).cumsum(dim=-1)
    # The rest of the target inside the block: > 0 (the block before ends below the target), and at
    # most what the block holds in this order of summation, so the search lands on a non-zero cell.
    rest = torch.minimum(target - before, inside[:, -1])
    j = torch.searchsorted(inside, rest[:, None]).squeeze(1).clamp(max=block - 1)
    return starts + j


def _truncated_probs(
    logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Candidates best-first and their probabilities after top-k then top-p (vLLM's order).

    logits [b, V], temperature/top_k/top_p [b]. Returns (ids [b, K], probs [b, K]) with zeros
    outside each row's kept set. Top-p is taken over the distribution renormalised after top-k.
    """
    vocab = logits.shape[-1]
    scaled = logits.double() / temperature[:, None]  # [b, V]
    k_on = top_k > 0
    if bool(k_on.all()):
        # Every row renormalises over its own top-k: the largest k holds every row's candidates.
        vals, ids = torch.topk(scaled, int(top_k.max()), dim=-1)  # [b, K], sorted best-first
        beyond_k = torch.arange(vals.shape[-1])[None, :] >= top_k[:, None]  # [b, K]
        probs = torch.softmax(vals.masked_fill(beyond_k, float("-inf")), dim=-1)
        return ids, _nucleus(probs, top_p)
    k = min(vocab, max(_NUCLEUS_FIRST_K, int(top_k.max())))
    lse_full = torch.logsumexp(scaled, dim=-1)  # [b]
    while True:
        vals, ids = torch.topk(scaled, k, dim=-1)  # [b, K], sorted best-first
        mass = torch.exp(torch.logsumexp(vals, dim=-1) - lse_full)  # [b] share of the full softmax
        # A row without top-k needs every token of its nucleus among the candidates.
        short = (~k_on) & (top_p < 1.0) & (mass < top_p)
        if k >= vocab or not bool(short.any()):
            break
        k = min(vocab, k * 8)
    position = torch.arange(k)[None, :]  # [1, K]
    keep_k = ~k_on[:, None] | (position < top_k[:, None])  # [b, K]
    vals = vals.masked_fill(~keep_k, float("-inf"))
    # Rows without top-k keep their share of the whole vocabulary (the candidates hold the nucleus).
    probs = torch.where(k_on[:, None], torch.softmax(vals, dim=-1), torch.exp(vals - lse_full[:, None]))
    return ids, _nucleus(probs, top_p)


def _nucleus(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Zero all but the smallest best-first prefix of probs [b, K] whose mass reaches top_p [b].

    A token is dropped when the mass before it already reaches top_p. Rows with top_p == 1 are left
    alone, so float rounding of a cumulative sum near 1.0 cannot cut their tail.
    """
    before = probs.cumsum(dim=-1) - probs
    drop = (top_p[:, None] < 1.0) & (before >= top_p[:, None])
    return probs.masked_fill(drop, 0.0)


@dataclass
class StopRule:
    """When a row's generation ends: EOS, a token-id stop sequence, or a stop string."""

    eos_ids: frozenset[int]
    token_seqs: tuple[tuple[int, ...], ...]
    strings: tuple[str, ...]
    # Detokenizes generated ids; only needed (and only loaded) when there are stop strings.
    decode: Callable[[list[int]], str] | None = None

    def __post_init__(self) -> None:
        # A character is at most 4 byte-level tokens, plus one token that may straddle the start,
        # so a stop string that just completed lies within the last 4 * len + 1 tokens. Decoding
        # only that window keeps each step O(len(stop string)), not O(generated tokens).
        self.window_tokens = 4 * max((len(s) for s in self.strings), default=0) + 1

    def hit(self, generated: list[int]) -> bool:
        """Whether the last token of `generated` (tokens of this row so far) ends the row."""
        last = generated[-1]
        if last in self.eos_ids:
            return True
        for seq in self.token_seqs:
            if len(generated) >= len(seq) and tuple(generated[-len(seq):]) == seq:
                return True
        if self.strings and self.decode is not None:
            # Checked after every token, so a match in the window is one the last token completed.
            tail = self.decode(generated[-self.window_tokens:])
            return any(s in tail for s in self.strings)
        return False
