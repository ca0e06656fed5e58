"""Sampling: `run_sample(engine, op)` prefills the prompt once and decodes `num_samples` rows.

Flow: validate (a bad request fails alone, before any state is touched) -> resolve the adapter slot
(a sampler checkpoint is loaded into the pool once, keyed by its path) -> prefill the prompt into a
KV cache -> optional prompt scoring -> repeat the cache per row -> decode all rows together, each
with its own slot, rules and stop rule -> one SampledSequence per row.

The decode loop works on `Row`s, not on a request, so fusing several requests' rows into one batch
(the scheduler's job, later) reuses it unchanged. Shapes: B rows, P prompt tokens, H hidden,
V vocab, K top-k.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

import numpy as np
import torch
from torch import nn

from tinkerd.engine.sampler.kv import KVBatch
from tinkerd.engine.sampler.rules import EMPTY_LOGPROB, RowRules, StopRule, choose_tokens, row_generators, validate
from tinkerd.errors import NotFoundError, ServerError
from tinkerd.types import SampledSequence, SampleOp, SampleResult

if TYPE_CHECKING:
    from tinkerd.engine.engine import Engine, ModelRuntime

log = logging.getLogger(__name__)

BASE_SLOT = -1

# Prompt positions scored per lm_head call: 128 x 151,669 fp32 logits = 78 MB at a time, instead
# of P x V at once.
_SCORE_CHUNK = 128


@dataclass
class Row:
    """One completion being generated; rows of any request can share a decode batch."""

    slot: int  # adapter slot, BASE_SLOT for the base model
    max_tokens: int
    stop: StopRule
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    stop_reason: Literal["stop", "length"] | None = None

    def append(self, token: int, logprob: float) -> bool:
        """Record a generated token; True when the row is finished (the token stays included)."""
        self.tokens.append(token)
        self.logprobs.append(logprob)
        if self.stop.hit(self.tokens):
            self.stop_reason = "stop"
        elif len(self.tokens) >= self.max_tokens:
            self.stop_reason = "length"
        return self.stop_reason is not None

    def result(self) -> SampledSequence:
        assert self.stop_reason is not None
        return SampledSequence(tokens=self.tokens, logprobs=self.logprobs, stop_reason=self.stop_reason)


def run_sample(engine: Engine, op: SampleOp) -> SampleResult:
    t0 = time.perf_counter()
    runtime = engine.runtime(op.base_model)
    validate(op, runtime.vocab_size, runtime.loaded.max_context_length)
    slot = adapter_slot(runtime, op.adapter_path)
    body, head = split_model(runtime.model)
    params = op.params
    stop = StopRule(
        eos_ids=frozenset(runtime.loaded.eos_token_ids) if params.stop_at_eos else frozenset(),
        token_seqs=tuple(tuple(int(t) for t in seq) for seq in params.stop_token_seqs),
        strings=params.stop_strings,
        decode=_decoder(runtime) if params.stop_strings else None,
    )
    rows = [Row(slot=slot, max_tokens=params.max_tokens, stop=stop) for _ in range(op.num_samples)]
    rules = RowRules.repeat(params.temperature, params.top_k, params.top_p, row_generators(params.seed, len(rows)))
    prompt = torch.as_tensor(op.prompt, dtype=torch.long)[None, :]  # [1, P]

    result = SampleResult(sequences=[])
    try:
        with torch.inference_mode():
            kv = KVBatch(body, runtime.model.config)
            runtime.ctx.set_single(slot)
            hidden = kv.prefill(prompt)[0]  # [P, H]
            if op.prompt_logprobs or op.topk_prompt_logprobs > 0:
                lp, topk = score_prompt(head, hidden, prompt[0], op.prompt_logprobs, op.topk_prompt_logprobs)
                result.prompt_logprobs, result.topk_prompt_logprobs = lp, topk
            kv.repeat(len(rows))
            decode(runtime, kv, rows, rules, hidden[-1:].expand(len(rows), -1))
    finally:
        runtime.ctx.clear()
    result.sequences = [row.result() for row in rows]
    log.debug(
        "sample: %d prompt tokens, %d rows, %d generated tokens in %.3f s",
        prompt.shape[1], len(rows), sum(len(r.tokens) for r in rows), time.perf_counter() - t0,
    )
    return result


def decode(runtime: ModelRuntime, kv: KVBatch, rows: list[Row], rules: RowRules, hidden: torch.Tensor) -> None:
    """Generate until every row is finished. hidden [B, H]: each row's last position so far.

    Finished rows leave the batch (and the KV cache) at once, so a long row does not carry the
    dead rows' attention cost through the rest of its decode.
    """
    _, head = split_model(runtime.model)
    active = list(range(len(rows)))  # indices into `rows` of the current batch rows, in order
    while True:
        runtime.ctx.set_rows([rows[i].slot for i in active])
        logits = head(hidden).float()  # [B, V]
        # The logprob reported for a sampled token is the log-softmax of the raw logits
        # (temperature 1, no top-k/top-p truncation): exactly what the trainer's forward computes
        # for that token, so RL importance ratios exp(learner - sampler) start at 1 and
        # kl_sample_train measures only real policy drift. The rules only decide which token.
        tokens = choose_tokens(logits, rules)  # [B]
        # logit - logsumexp = log_softmax at the chosen token, without a second [B, V] tensor.
        token_lp = logits.gather(1, tokens[:, None]).squeeze(1) - torch.logsumexp(logits, dim=-1)  # [B]
        still = [
            b for b, i in enumerate(active) if not rows[i].append(int(tokens[b]), float(token_lp[b]))
        ]  # batch positions of rows that go on
        if not still:
            return
        if len(still) < len(active):
            kv.keep(still)
            rules = rules.select(still)
            active = [active[b] for b in still]
            tokens = tokens[still]
        runtime.ctx.set_rows([rows[i].slot for i in active])
        hidden = kv.step(tokens)  # [B, H]


def score_prompt(
    head: nn.Module, hidden: torch.Tensor, prompt: torch.Tensor, want_logprobs: bool, k: int
) -> tuple[np.ndarray | None, tuple[np.ndarray, np.ndarray] | None]:
    """Logprob of prompt[i] given prompt[:i] for every i, and the top-k alternatives per position.

    hidden [P, H] (the prefill's final hidden states), prompt [P]. Returns (logprobs [P] float32
    with NaN at 0, (ids [P, K] int64, logprobs [P, K] float32) best-first with row 0 empty).
    """
    n = prompt.shape[0]
    lp = np.full(n, np.nan, dtype=np.float32) if want_logprobs else None
    topk = None
    if k > 0:
        topk = (np.zeros((n, k), dtype=np.int64), np.full((n, k), EMPTY_LOGPROB, dtype=np.float32))
    # Position i's logits predict token i + 1; chunks bound the [chunk, V] logits in memory.
    for start in range(0, n - 1, _SCORE_CHUNK):
        end = min(n - 1, start + _SCORE_CHUNK)
        chunk_lp = torch.log_softmax(head(hidden[start:end]).float(), dim=-1)  # [c, V]
        if lp is not None:
            targets = prompt[start + 1 : end + 1, None]
            lp[start + 1 : end + 1] = chunk_lp.gather(1, targets).squeeze(1).numpy()
        if topk is not None:
            vals, ids = torch.topk(chunk_lp, k, dim=-1)  # [c, K], sorted best-first
            topk[0][start + 1 : end + 1] = ids.numpy()
            topk[1][start + 1 : end + 1] = vals.numpy()
    return lp, topk


def split_model(model: nn.Module) -> tuple[nn.Module, nn.Module]:
    """The decoder body and the (multi-LoRA) lm_head of a causal LM.

    Logits are computed as head(body(x)), which is what the HF forward does for Qwen3 / Llama.
    Models that post-process logits (Gemma 2's soft-capping) would silently sample from the wrong
    distribution, so they are refused instead.
    """
    if getattr(model.config, "final_logit_softcapping", None):
        raise ServerError(f"{type(model).__name__} soft-caps its logits; the sampler does not support that")
    return model.get_decoder(), model.get_output_embeddings()


def adapter_slot(runtime: ModelRuntime, adapter_path: str | None) -> int:
    """The slot serving `adapter_path`: loaded into the pool once, reused while the files stand.

    Keyed by the path; the directory's (inode, mtime) is remembered so a checkpoint re-saved under
    the same path (written to a temporary name and renamed in place) is reloaded, not served stale.
    """
    if adapter_path is None:
        return BASE_SLOT
    try:
        st = os.stat(adapter_path)
    except OSError:
        raise NotFoundError(f"no sampler weights at {adapter_path!r}") from None
    fingerprint = (st.st_ino, st.st_mtime_ns)
    pool = runtime.pool
    if adapter_path in pool:
        adapter = pool.get(adapter_path)
        if adapter.extra.get("fingerprint") == fingerprint:
            return adapter.slot
        pool.remove(adapter_path)
    files = _read_adapter(adapter_path)
    adapter = pool.create_from_tensors(adapter_path, files.spec, files.weights, trainable=False)
    adapter.extra["fingerprint"] = fingerprint
    return adapter.slot


def _read_adapter(path: str):
    # Imported here, not at the top: checkpoints.py brings in the PEFT file format, which only
    # requests naming a sampler checkpoint need.
    from tinkerd.engine.checkpoints import read_adapter

    return read_adapter(path)


def _decoder(runtime: ModelRuntime):
    tokenizer = runtime.tokenizer

    def decode(ids: list[int]) -> str:
        # Special tokens are kept so a stop string like "<|im_end|>" matches its token.
        return tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)

    return decode
