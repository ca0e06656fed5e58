"""The decode batch's KV cache: prefill once, repeat per row, drop finished rows, step one token.

A thin owner of transformers' DynamicCache for the decoder body (the model without its lm_head):
the sampler applies the (multi-LoRA) head itself, so prompt scoring can run it in chunks instead of
materialising [P, V] logits at once (4096 x 151,669 fp32 = 2.5 GB for Qwen3's vocabulary).

Today every row of a batch has the same length (num_samples completions of one prompt). Fusing
requests with different prompt lengths needs left padding, an attention mask and per-row position
ids here; the decode loop above does not change.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import DynamicCache


class KVBatch:
    def __init__(self, body: nn.Module, config):
        self.body = body
        self.cache = DynamicCache(config=config)
        self.rows = 0

    def prefill(self, prompt: torch.Tensor) -> torch.Tensor:
        """Run the prompt [1, P] through the body once; returns the final hidden states [1, P, H]."""
        out = self.body(input_ids=prompt, cache=self.cache, use_cache=True)
        self.rows = 1
        return out.last_hidden_state

    def repeat(self, n: int) -> None:
        """Turn the one prefilled row into n identical rows (the prompt is never recomputed)."""
        if self.rows != 1:
            raise RuntimeError("repeat() expects exactly one prefilled row")
        if n > 1:
            self.cache.batch_repeat_interleave(n)
        self.rows = n

    def keep(self, rows: list[int]) -> None:
        """Keep only these rows (indices into the current batch), e.g. after some finished."""
        if len(rows) == self.rows:
            return
        self.cache.batch_select_indices(torch.tensor(rows, dtype=torch.long))
        self.rows = len(rows)

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        """Append one token per row, tokens [B]; returns the new hidden state [B, H]."""
        out = self.body(input_ids=tokens[:, None], cache=self.cache, use_cache=True)
        return out.last_hidden_state[:, -1]
