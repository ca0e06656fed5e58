"""What a sampling request may ask of its prompt beyond prompt logprobs, computed in its prefill:

- `target_prompt_logprobs` (SampleRequest): the logprobs of named token ids at every prompt
  position: ids [P-1, K] int64, row i scored at prompt position i + 1 (predicted by the hidden
  state of position i); a cell of -1 names nothing and gets 0.0.
- `prompt_alt_tokens_k`: k independent draws, with replacement, at the request's temperature
  (only: no top-k / top-p, as the SDK documents), from the model's next-token distribution at every
  prompt position after the first, with each draw's raw logprob (log-softmax at temperature 1, as
  sampled tokens' logprobs are). Temperature 0 draws the argmax k times.

The draws' uniforms are taken for the whole prompt when the request is admitted, from a stream of
its own derived from the request's seed, so the draws do not depend on how the prefill is chunked
or packed beside other requests. Shapes: P prompt tokens, c positions scored at once, V vocab.
"""

from __future__ import annotations

import hashlib
import secrets

import numpy as np
import torch

from tinkerd.engine.sampler.rules import MAX_TOPK_PAIRS
from tinkerd.errors import UserError
from tinkerd.types import SampleOp

_GREEDY_BELOW = 1e-5  # as rules.py: below it, sampling is argmax


def validate(op: SampleOp, vocab_size: int) -> None:
    rows = int(op.prompt.shape[0]) - 1
    targets = op.target_prompt_ids
    if targets is not None:
        if targets.ndim != 2 or targets.shape[0] != rows:
            raise UserError(f"target_prompt_logprobs must have shape [len(prompt) - 1, K] = [{rows}, K], "
                            f"got {list(targets.shape)}")
        if targets.size and (int(targets.min()) < -1 or int(targets.max()) >= vocab_size):
            bad = int(targets.min()) if int(targets.min()) < -1 else int(targets.max())
            raise UserError(f"target_prompt_logprobs token id {bad} is outside the vocabulary [0, {vocab_size}) "
                            f"(-1 names nothing)")
        if targets.size > MAX_TOPK_PAIRS:
            raise UserError(f"target_prompt_logprobs asks for {targets.size} logprobs; at most {MAX_TOPK_PAIRS}")
    k = op.prompt_alt_tokens_k
    if k < 0 or k * max(rows, 1) > MAX_TOPK_PAIRS:
        raise UserError(f"prompt_alt_tokens_k must be in [0, {MAX_TOPK_PAIRS // max(rows, 1)}] for a "
                        f"{rows + 1}-token prompt, got {k}")


def alt_uniforms(seed: int | None, rows: int, k: int) -> torch.Tensor:
    """[rows, k] float64 uniforms for the draws, from the request's own stream."""
    base = seed if seed is not None else secrets.randbits(64)
    digest = hashlib.blake2b(f"{base}:prompt_alt_tokens".encode(), digest_size=8).digest()
    gen = torch.Generator().manual_seed(int.from_bytes(digest, "little"))
    return torch.rand((rows, k), generator=gen, dtype=torch.float64)


def target_logprobs(lp: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """lp [c, V] log-softmax, ids [c, K] (-1 = none) -> [c, K] float32, 0.0 where none."""
    named = ids >= 0
    return torch.where(named, lp.gather(1, ids.clamp(min=0)), torch.zeros((), dtype=lp.dtype)).float()


def alt_draws(logits: torch.Tensor, lp: torch.Tensor, u: torch.Tensor, temperature: float
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """logits / lp [c, V], u [c, k] -> (ids [c, k] int64, their raw logprobs [c, k] float32)."""
    if temperature < _GREEDY_BELOW:
        ids = logits.argmax(dim=-1, keepdim=True).expand(-1, u.shape[1])
    else:
        cdf = torch.softmax(logits.double() / temperature, dim=-1).cumsum(dim=-1)  # [c, V]
        # First cdf >= (1 - u) * total: never a zero-probability cell (rules._inverse_cdf, batched).
        ids = torch.searchsorted(cdf, (1.0 - u) * cdf[:, -1:], right=False).clamp(max=logits.shape[-1] - 1)
    return ids, lp.gather(1, ids).float()


def empty_results(op: SampleOp) -> tuple[np.ndarray | None, tuple[np.ndarray, np.ndarray] | None]:
    """The result arrays, filled as the prefill scores its chunks."""
    rows = int(op.prompt.shape[0]) - 1
    targets = None
    if op.target_prompt_ids is not None:
        targets = np.zeros(op.target_prompt_ids.shape, dtype=np.float32)
    alt = None
    if op.prompt_alt_tokens_k > 0:
        alt = (np.zeros((rows, op.prompt_alt_tokens_k), dtype=np.int64),
               np.zeros((rows, op.prompt_alt_tokens_k), dtype=np.float32))
    return targets, alt
