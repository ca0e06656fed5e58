"""The decode batch's bookkeeping: a request and the completions (rows) it generates.

Split from sample.py, whose Sampler moves rows through prefill, the batch and completion.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

import numpy as np

from tinkerd.engine.sampler.prefill import Prefill
from tinkerd.engine.sampler.rules import RowRules, StopRule
from tinkerd.types import SampledSequence, SampleOp, SampleResult, TokenDelta

if TYPE_CHECKING:
    from tinkerd.engine.lora.pool import Adapter

BASE_SLOT = -1


@dataclass
class Row:
    """One completion being generated; rows of any request can share a decode batch."""

    request: Request
    slot: int  # adapter slot, BASE_SLOT for the base model
    max_tokens: int
    stop: StopRule
    topk: int = 0  # top-k alternatives recorded per generated token
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    topk_ids: list[np.ndarray] = field(default_factory=list)  # each [K]
    topk_logprobs: list[np.ndarray] = field(default_factory=list)  # each [K]
    stop_reason: Literal["stop", "length"] | None = None
    index: int = 0  # the sample's place in its request (TokenDelta.row)

    def append(self, token: int, logprob: float) -> bool:
        """Record a generated token; True when the row is finished (the token stays included)."""
        self.tokens.append(token)
        self.logprobs.append(logprob)
        if self.stop.hit(self.tokens):
            self.stop_reason = "stop"
        elif len(self.tokens) >= self.max_tokens:
            self.stop_reason = "length"
        return self.stop_reason is not None

    def last_token(self) -> TokenDelta:
        """The token appended last, for a streaming request (SampleOp.stream): one per step."""
        n = len(self.tokens) - 1
        topk = (self.topk_ids[n][None], self.topk_logprobs[n][None]) if self.topk else None
        return TokenDelta(self.index, n, self.tokens[n:], self.logprobs[n:], topk)

    def result(self) -> SampledSequence:
        assert self.stop_reason is not None
        topk = (np.stack(self.topk_ids), np.stack(self.topk_logprobs)) if self.topk else None
        return SampledSequence(tokens=self.tokens, logprobs=self.logprobs, stop_reason=self.stop_reason, topk_logprobs=topk)


@dataclass
class Request:
    ticket: str
    op: SampleOp
    adapter: Adapter | None  # the pool entry held while in flight; None for the base model
    prefill: Prefill
    rows: list[Row] = field(default_factory=list)
    rules: RowRules | None = None
    unfinished: int = 0
    # Another joining request prefilling the same weights and prompt (prefix.py): this one runs no
    # prefill of its own and joins the batch from the leader's when that finishes.
    leader: Request | None = None
    admitted_at: float = field(default_factory=time.perf_counter)

    @property
    def slot(self) -> int:
        return self.adapter.slot if self.adapter is not None else BASE_SLOT

    def result(self) -> SampleResult:
        pf = self.prefill
        return SampleResult(
            sequences=[row.result() for row in self.rows], prompt_logprobs=pf.logprobs, topk_prompt_logprobs=pf.topk,
            target_prompt_logprobs=pf.targets, prompt_alt_tokens=pf.alt, prompt_cache_hit_tokens=pf.cached,
        )
