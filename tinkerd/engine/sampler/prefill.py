"""Prefill: one request's prompt through the decoder body, chunk by chunk, scored as it goes.

A prompt is prefilled in chunks of at most the step's prefill budget, so a 4k-token prompt joining
the batch delays the other rows' next token by one chunk, not by the whole prompt. Each chunk's
final hidden states [c, H] are scored for prompt logprobs right away and then dropped; only the
last position's hidden state is kept, to pick the first generated token.

Shapes: P prompt tokens, c chunk, H hidden, V vocab, K top-k.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn
from transformers import DynamicCache

from tinkerd.engine.sampler import prompt_scores
from tinkerd.engine.sampler.kv import prefill_cache
from tinkerd.engine.sampler.rules import EMPTY_LOGPROB

# Prompt positions scored per lm_head call: 128 x 151,669 fp32 logits = 78 MB at a time, instead
# of P x V at once.
_SCORE_CHUNK = 128


@dataclass
class Prefill:
    prompt: torch.Tensor  # [P] int64
    cache: DynamicCache
    want_logprobs: bool
    k: int  # top-k alternatives per scored position; 0 = none
    # First position whose logits are scored: position i predicts prompt[i + 1], so scoring the
    # last N prompt tokens starts at P - 1 - N (0 = score everything).
    score_from: int
    done: int = 0  # prompt tokens through the body so far
    cached: int = 0  # of those, taken from the prefix cache (prefix.py) instead
    last_hidden: torch.Tensor | None = None  # [1, H] of position done - 1
    logprobs: np.ndarray | None = None  # [P] float32, NaN where not scored
    topk: tuple[np.ndarray, np.ndarray] | None = None  # ([P, K] ids, [P, K] logprobs), empty rows
    chunk_calls: list[int] = field(default_factory=list)  # tokens per body call, for tests and logs
    # target_prompt_logprobs and prompt_alt_tokens (prompt_scores.py): scored at every position,
    # whatever score_from says. Set by `also_score`.
    target_ids: torch.Tensor | None = None  # [P-1, K] int64, -1 = none
    targets: np.ndarray | None = None  # [P-1, K] float32
    alt_u: torch.Tensor | None = None  # [P-1, k] float64 uniforms
    alt_temperature: float = 1.0
    alt: tuple[np.ndarray, np.ndarray] | None = None  # ([P-1, k] ids, [P-1, k] logprobs)
    # A prompt with images (vision-language models, sample.py: _with_images): the VLM body and its
    # keyword inputs (pixel_values, image_grid_thw, mm_token_type_ids, M-RoPE position_ids); it is
    # prefilled whole in one forward. rope_delta: its decode positions' offset (M-RoPE).
    images: dict | None = None
    vlm_body: nn.Module | None = None
    rope_delta: int = 0

    @staticmethod
    def start(
        prompt: np.ndarray, config, device: torch.device, want_logprobs: bool, k: int, last_n: int | None
    ) -> Prefill:
        n = int(prompt.shape[0])
        scored = n - 1 if last_n is None else min(last_n, n - 1)
        pf = Prefill(
            prompt=torch.as_tensor(prompt, dtype=torch.long, device=device),
            cache=prefill_cache(config),
            want_logprobs=want_logprobs,
            k=k,
            score_from=n - 1 - scored,
        )
        if want_logprobs:
            pf.logprobs = np.full(n, np.nan, dtype=np.float32)
        if k > 0:
            pf.topk = (np.zeros((n, k), dtype=np.int64), np.full((n, k), EMPTY_LOGPROB, dtype=np.float32))
        return pf

    def also_score(self, op) -> None:
        """Ask this prefill for the request's target_prompt_logprobs and prompt_alt_tokens."""
        self.targets, self.alt = prompt_scores.empty_results(op)
        if op.target_prompt_ids is not None:
            self.target_ids = torch.as_tensor(op.target_prompt_ids, dtype=torch.long, device=self.prompt.device)
        if op.prompt_alt_tokens_k > 0:
            rows = int(self.prompt.shape[0]) - 1
            self.alt_u = prompt_scores.alt_uniforms(op.params.seed, rows, op.prompt_alt_tokens_k).to(self.prompt.device)
            self.alt_temperature = op.params.temperature

    @property
    def scores(self) -> bool:
        return self.want_logprobs or self.k > 0 or self.targets is not None or self.alt is not None

    @property
    def finished(self) -> bool:
        return self.done == self.prompt.shape[0]

    @property
    def remaining(self) -> int:
        return int(self.prompt.shape[0]) - self.done

    def advance(self, body: nn.Module, head: nn.Module, budget: int) -> int:
        """Run up to `budget` more prompt tokens through the body; returns how many ran."""
        start = self.done
        end = min(int(self.prompt.shape[0]), start + budget)
        if self.images is not None:  # whole, through the VLM body: its tower runs once
            end = int(self.prompt.shape[0])
            out = self.vlm_body(input_ids=self.prompt[None], cache=self.cache, use_cache=True, **self.images)
            self.images = None  # the pixels are not needed again
        else:
            out = body(input_ids=self.prompt[None, start:end], cache=self.cache, use_cache=True)
        hidden = out.last_hidden_state[0]  # [c, H]
        if self.scores:
            self._score(head, hidden, start)
        self.last_hidden = hidden[-1:]
        self.done = end
        self.chunk_calls.append(end - start)
        return end - start

    def _score(self, head: nn.Module, hidden: torch.Tensor, offset: int) -> None:
        """Score the positions of this chunk (hidden [c, H] at offset) that predict a prompt token."""
        n = int(self.prompt.shape[0])
        every = self.targets is not None or self.alt is not None
        lo = max(offset, 0 if every else self.score_from)
        hi = min(offset + hidden.shape[0], n - 1)  # the last position predicts a generated token
        for a in range(lo, hi, _SCORE_CHUNK):
            b = min(hi, a + _SCORE_CHUNK)
            logits = head(hidden[a - offset : b - offset]).float()  # [c, V]
            lp = torch.log_softmax(logits, dim=-1)
            if self.targets is not None:
                self.targets[a:b] = prompt_scores.target_logprobs(lp, self.target_ids[a:b]).cpu().numpy()
            if self.alt is not None:
                ids, lps = prompt_scores.alt_draws(logits, lp, self.alt_u[a:b], self.alt_temperature)
                self.alt[0][a:b], self.alt[1][a:b] = ids.cpu().numpy(), lps.cpu().numpy()
            s = max(a, self.score_from)  # prompt logprobs and top-k: only the last N when asked
            if s >= b:
                continue
            if self.logprobs is not None:
                targets = self.prompt[s + 1 : b + 1, None]
                self.logprobs[s + 1 : b + 1] = lp[s - a :].gather(1, targets).squeeze(1).cpu().numpy()
            if self.topk is not None:
                vals, ids = torch.topk(lp[s - a :], self.k, dim=-1)  # [c, K] sorted best-first
                self.topk[0][s + 1 : b + 1] = ids.cpu().numpy()
                self.topk[1][s + 1 : b + 1] = vals.cpu().numpy()


def advance_packed(prefills: list[Prefill], body: nn.Module, head: nn.Module) -> None:
    """Whole prompts of several fresh requests through the body in one forward, packed end to end.

    Eight short prompts prefilled one by one stream the weights eight times with a few rows each;
    packed into one [1, T] sequence they stream them once, the step's matmuls become compute-bound
    and it costs about what the longest alone would. A block-diagonal causal mask and per-prompt
    positions keep each prompt seeing only itself, so its cache and hidden states are those of a
    prefill alone (within float rounding). All must be unstarted and share one adapter slot (the
    multi-LoRA routing is per batch row, and this is one row).
    """
    lengths = [pf.remaining for pf in prefills]
    assert all(pf.done == 0 for pf in prefills)
    device = prefills[0].prompt.device
    ids = torch.cat([pf.prompt for pf in prefills])[None]  # [1, T]
    positions = torch.cat([torch.arange(n, device=device) for n in lengths])[None]  # [1, T]
    owner = torch.repeat_interleave(torch.arange(len(prefills), device=device), torch.tensor(lengths, device=device))
    col = torch.arange(ids.shape[1], device=device)
    mask = (owner[:, None] == owner[None, :]) & (col[None, :] <= col[:, None])  # [T, T] True = attend
    packed = DynamicCache(config=body.config)
    out = body(input_ids=ids, attention_mask=mask[None, None], position_ids=positions, cache=packed, use_cache=True)
    hidden = out.last_hidden_state[0]  # [T, H]
    start = 0
    for pf, n in zip(prefills, lengths):
        for i, layer in enumerate(packed.layers):
            # DynamicCache.update concatenates onto an empty layer: each prompt gets its own copy.
            pf.cache.update(layer.keys[:, :, start : start + n], layer.values[:, :, start : start + n], i)
        own = hidden[start : start + n]
        if pf.scores:
            pf._score(head, own, 0)
        pf.last_hidden = own[-1:]
        pf.done = n
        pf.chunk_calls.append(n)
        start += n
