"""The sampler engine: one continuous decode batch per base model.

Requests are admitted at any step (`Sampler.admit`) and finish at any step (`Sampler.step` returns
them). Each step: (1) joining requests advance their prefill by a shared token budget; a request
whose prompt is done joins the decode batch as `num_samples` rows sharing that one prefill;
(2) every row in the batch gets one token: the (multi-LoRA) head on each row's last hidden state,
token choice by the row's own rules and random stream, stop checks; finished rows leave the batch
and the KV cache; the others run one body forward together, each row with its own adapter slot,
position and attention mask (kv.py). Rows of any request, adapter and prompt length share the batch.

A bad request fails alone at `admit`, before any state is touched; an unexpected error inside a
step fails the requests in that batch, never the engine. Shapes: B rows, H hidden, V vocab, K top-k.
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch

from tinkerd.engine.grouped import GROUPED
from tinkerd.engine.lora.layers import pack_for_decode
from tinkerd.engine.sampler.adapters import acquire_adapter, split_model
from tinkerd.engine.sampler.decode import FusedDecode
from tinkerd.engine.sampler.budget import KvBudget
from tinkerd.engine.sampler.hybrid import is_hybrid, new_batch_cache
from tinkerd.engine.sampler.kv import sliding_window, window_masks
from tinkerd.engine.sampler import prompt_scores
from tinkerd.engine.sampler.prefill import Prefill, advance_packed
from tinkerd.engine.sampler.prefix import PrefixCache, prefix_name
from tinkerd.engine.sampler.rows import BASE_SLOT, Request, Row
from tinkerd.engine.sampler.rules import RowRules, StopRule, choose_tokens, row_generators, validate
from tinkerd.errors import ServerError, TinkerdError, UserError
from tinkerd.types import SampleOp, SampleResult, TokenDelta

if TYPE_CHECKING:
    from tinkerd.engine.engine import Engine, ModelRuntime
    from tinkerd.engine.lora.pool import Adapter

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SamplerConfig:
    # Prompt tokens prefilled per step over all joining requests. A step (and so every decoding
    # row's next token) waits for less than twice this much prefill: longer prompts are cut to what
    # is left of it, but one no longer than this goes whole into the first step with any left.
    # 128 tokens of SmolLM2-135M are ~0.3 s on one core, against ~50 ms for a decode step of 8
    # rows. Prefill is already compute-bound from ~20 tokens a forward on CPU, so smaller chunks
    # cost little throughput.
    prefill_tokens_per_step: int = 128
    # Sampler adapters (loaded from checkpoint paths) kept in the pool; idle ones beyond are evicted,
    # least recently used first. 8 rank-32 SmolLM2-135M adapters are 360 MB; an RL loop needs one.
    max_sampler_adapters: int = 8
    # Pack the base linears for oneDNN on CPU (layers.pack_for_decode): an 8-row step's linears take
    # ~35 ms instead of ~80 ms on SmolLM2-135M in fp32 (a bf16 step: 42 instead of 66 ms), for one
    # more copy of the weights.
    pack_weights: bool = True
    # Decode steps of Llama-family models through decode.FusedDecode instead of the HF layer
    # classes: the same modules and math with ~1/3 fewer ops per layer (SmolLM2-135M, 8 rows).
    fused_decode: bool = True
    # Bytes the decode batch's KV cache may reach (None: a quarter of the device's memory, see
    # kv.default_kv_budget). A request that alone would need more is refused at admission; one that
    # does not fit beside the rows in flight waits, in admission order, until rows leave.
    kv_cache_bytes: int | None = None
    # Keep finished prefills, keyed by the weights and the prompt, inside the KV budget (prefix.py):
    # GRPO's group of requests with one prompt, and prompts sharing a system prompt, prefill once.
    prefix_cache: bool = True
    # Keep a prompt that several rows decode from (num_samples, or a group following one prefill)
    # once in the decode batch (shared.py; fused decode step only): at 32 rows of 256-token prompts
    # on SmolLM2-135M, ~80 ms of a ~240 ms step was reading the copies.
    share_prompts: bool = True


class Sampler:
    """The in-flight sampling state of one base model: joining requests and the decode batch."""

    def __init__(self, runtime: ModelRuntime, config: SamplerConfig = SamplerConfig()):
        self.rt = runtime
        self.config = config
        self.body, self.head = split_model(runtime.model)
        self.device = next(runtime.model.parameters()).device
        self.joining: list[Request] = []  # admitted, prefill not finished, in admission order
        self.rows: list[Row] = []  # the decode batch, in KV cache row order
        self.rules: RowRules | None = None  # aligned with self.rows
        self.hidden: torch.Tensor | None = None  # [B, H] each row's last hidden state, awaiting the head
        # A vision-language config keeps its language model's shape in text_config.
        self.text_config = runtime.model.config.get_text_config()
        self._routing: tuple[tuple[int, ...], list] | None = None  # (slots, ctx.groups) memo
        # Streaming requests' tokens of the steps since the last take_streamed (SampleOp.stream).
        self.streamed: dict[str, list[TokenDelta]] = {}
        # What the decode batch's KV cache may take, and what a row of it takes (budget.py).
        self.kv = KvBudget.of(self.text_config, next(runtime.model.parameters()).dtype, self.device,
                              config.kv_cache_bytes)
        # Sliding-window layers (gpt-oss) get their own decode mask (kv.window_masks).
        self.window = sliding_window(self.text_config)
        # Packing prompts end to end into one row would run them through one recurrent state, and
        # its block-diagonal mask has no window.
        self.pack_prompts = not is_hybrid(self.text_config) and self.window is None
        # M-RoPE (vision-language models): decode positions carry each row's image offset.
        self.vision = runtime.loaded.vision
        if config.pack_weights:
            pack_for_decode(runtime.layers)
        # After packing: the fused step binds each linear's packed weight once.
        # (The fused step builds a full-attention mask only: a model with a window keeps the HF path.)
        self.fused = FusedDecode.build(self.body) if config.fused_decode and self.window is None else None
        self.cache = self._new_cache()
        self.kv = replace(self.kv, shared=self.cache.shared is not None)
        # Finished prefills kept for later requests with the same weights and prompt (prefix.py).
        self.prefix = PrefixCache(self.kv.token_bytes, self.kv.state_bytes, partial=self.pack_prompts) \
            if config.prefix_cache else None

    def _new_cache(self):
        # The fused step reads prompts that rows share once (shared.py); the HF path needs each
        # row's whole columns.
        return new_batch_cache(self.text_config, len(self.body.layers),
                               shared=self.fused is not None and self.config.share_prompts)

    def kv_cache_bytes(self) -> int:
        """The decode batch's KV cache as allocated now (rows x columns x bytes per position, plus
        each row's linear-attention states, plus the prompts rows share)."""
        shared = self.cache.shared.nbytes() if self.cache.shared is not None else 0
        return self.cache.rows * (self.cache.capacity * self.kv_token_bytes + self.row_state_bytes) + shared

    @property
    def kv_token_bytes(self) -> int:
        return self.kv.token_bytes

    @property
    def row_state_bytes(self) -> int:
        return self.kv.state_bytes

    @property
    def kv_budget(self) -> int:
        return self.kv.limit

    @property
    def active_rows(self) -> int:
        return len(self.rows) + sum(r.op.num_samples for r in self.joining)

    # -- admission -------------------------------------------------------------------------------

    def admit(self, ticket: str, op: SampleOp) -> None:
        """Queue a request for prefill; raises (a UserError for bad input) with nothing changed."""
        validate(op, self.rt.vocab_size, self.rt.loaded.max_context_length)
        prompt_scores.validate(op, self.rt.vocab_size)
        self.kv.check(op)
        adapter = acquire_adapter(self.rt, op.adapter_path, self.config.max_sampler_adapters)
        try:
            prefill = Prefill.start(
                op.prompt, self.text_config, self.device, op.prompt_logprobs,
                op.topk_prompt_logprobs, op.prompt_logprobs_last_n,
            )
            prefill.also_score(op)
            if op.images:
                self._with_images(prefill, op)
            req = Request(ticket, op, adapter, prefill)
            p = op.params
            stop = StopRule(
                eos_ids=frozenset(self.rt.loaded.eos_token_ids) if p.stop_at_eos else frozenset(),
                token_seqs=tuple(tuple(int(t) for t in seq) for seq in p.stop_token_seqs),
                strings=p.stop_strings,
                decode=_decoder(self.rt) if p.stop_strings else None,
            )
            req.rows = [Row(req, req.slot, p.max_tokens, stop, op.topk_sample_logprobs, index=i)
                        for i in range(op.num_samples)]
            req.rules = RowRules.repeat(p.temperature, p.top_k, p.top_p, row_generators(p.seed, op.num_samples))
            req.unfinished = op.num_samples
        except BaseException:
            self._release(adapter)
            raise
        self.joining.append(req)

    # -- one step --------------------------------------------------------------------------------

    def step(self) -> list[tuple[str, object]]:
        """Advance prefills by one budget and every decoding row by one token; returns what finished."""
        done: list[tuple[str, object]] = []
        with torch.inference_mode(), self._sampling_mode():
            self._prefill(done)
            if self.rows:
                try:
                    self._decode(done)
                except Exception as e:  # a bug fails this batch's requests, not the engine loop
                    log.exception("decode step failed")
                    self._fail_batch(done, ServerError(f"{type(e).__name__}: {e}"))
        return done

    def _prefill(self, done: list) -> None:
        if not self.joining:
            return
        budget = self.config.prefill_tokens_per_step
        ready: list[Request] = []
        packed: dict[int, list[Request]] = {}  # unstarted prompts that fit whole, by adapter slot
        room, waiting = self.kv.room(self.rows, self.joining, self.prefix), False
        # Requests prefilling a cacheable prompt, by (weights, prompt): later ones follow them.
        leaders = {name: req for req in self.joining if req.prefill.done > 0 and req.leader is None
                   and (name := prefix_name(req)) is not None}
        for req in list(self.joining):
            if req.leader is not None:
                if not any(other is req.leader for other in self.joining):  # it failed or was cancelled: prefill alone
                    req.leader = None
                continue
            if req.prefill.done == 0:
                if waiting or not room(req):
                    waiting = True  # it waits for rows to leave, and those admitted after it wait behind it
                    continue
                if self.prefix is not None and self.prefix.start(req, leaders):
                    if req.prefill.finished:  # a whole-prompt hit
                        ready.append(req)
                    if req.prefill.finished or req.leader is not None:
                        continue
            if budget <= 0:
                continue  # later requests may still be hits or followers, which need no budget
            if req.prefill.done == 0 and req.prefill.remaining <= self.config.prefill_tokens_per_step \
                    and req.prefill.images is None:
                # A prompt that fits one step's budget is never split, even past what is left of it
                # this step: a 23-token prompt cut 22 + 1 costs two more weight streams and joins
                # the batch a step late, which then ends with steps of one row (-6% on the sampling
                # benchmark's 8 prompts of 129 tokens in all).
                packed.setdefault(req.slot, []).append(req)
                budget -= req.prefill.remaining
                continue
            try:
                self._set_routing([req.slot])
                budget -= req.prefill.advance(self.body, self.head, budget)
            except Exception as e:
                self._fail_prefill([req], done, e)
                continue
            if req.prefill.finished:
                ready.append(req)
        for slot, reqs in packed.items():
            try:
                self._set_routing([slot])
                if len(reqs) == 1 or not self.pack_prompts:
                    for req in reqs:
                        req.prefill.advance(self.body, self.head, req.prefill.remaining)
                else:
                    advance_packed([r.prefill for r in reqs], self.body, self.head)
            except Exception as e:
                self._fail_prefill(reqs, done, e)
                continue
            ready.extend(reqs)
        ready += self.prefix.followers_of(ready, self.joining) if self.prefix is not None else []
        order = {id(r): i for i, r in enumerate(self.joining)}
        ready.sort(key=lambda r: order[id(r)])  # batch rows in admission order, however prefilled
        for req in ready:
            self.joining.remove(req)
        if ready and self.prefix is not None:
            spare = self.kv.spare(self.rows + [row for req in ready for row in req.rows], self.joining)
            for req in ready:
                self.prefix.add(req, spare)
        if ready:
            try:
                self._join(ready)
            except Exception as e:  # the batch's cache may be half rebuilt: fail it with the joiners
                log.exception("joining the decode batch failed")
                error = ServerError(f"{type(e).__name__}: {e}")
                in_batch = {id(r.request) for r in self.rows}  # those _fail_batch fails
                for req in ready:
                    if id(req) not in in_batch:
                        req.unfinished = 0
                        self._finish(req, done, error)
                self._fail_batch(done, error)

    def _fail_prefill(self, reqs: list[Request], done: list, e: Exception) -> None:
        log.exception("prefill failed")
        error = e if isinstance(e, TinkerdError) else ServerError(f"{type(e).__name__}: {e}")
        for req in reqs:
            self.joining.remove(req)
            self._finish(req, done, error)

    def _join(self, ready: list[Request]) -> None:
        """Move prefilled requests' rows into the decode batch (cache, hidden, rules, rows) at once."""
        self.cache.join([(req.prefill.cache, len(req.rows)) for req in ready], [req.op.params.max_tokens for req in ready])
        hidden = [] if self.hidden is None else [self.hidden]
        rules = [] if self.rules is None else [self.rules]
        for req in ready:
            req.prefill.cache = None  # its keys/values now live in the batch cache
            hidden.append(req.prefill.last_hidden.expand(len(req.rows), -1))  # [n, H]: samples start alike
            rules.append(req.rules)
            self.rows.extend(req.rows)
        self.hidden = torch.cat(hidden)  # [B, H]
        self.rules = RowRules.stack(rules)

    def _decode(self, done: list) -> None:
        rows = self.rows
        self._set_routing([r.slot for r in rows])
        logits = self.head(self.hidden).float()  # [B, V]
        # The logprob reported for a sampled token is the log-softmax of the raw logits
        # (temperature 1, no top-k/top-p truncation): exactly what the trainer's forward computes
        # for that token, so RL importance ratios exp(learner - sampler) start at 1 and
        # kl_sample_train measures only real policy drift. The rules only decide which token.
        # The rules keep their per-row state (generators, top-k, uniforms) on the CPU; no-ops there.
        tokens = choose_tokens(logits.cpu(), self.rules).to(logits.device)  # [B]
        # log_softmax is logit - logsumexp in one pass: ~0.2 ms at 8 x 49k on one thread, where
        # logsumexp alone took ~0.4-0.6 (its exp runs as a separate, slower kernel).
        logprobs = torch.log_softmax(logits, dim=-1)  # [B, V]
        token_lp = logprobs.gather(1, tokens[:, None]).squeeze(1).tolist()
        self._record_topk(rows, logprobs)
        still = []  # batch positions of rows that go on
        for b, (row, token) in enumerate(zip(rows, tokens.tolist())):
            finished = row.append(token, token_lp[b])
            if row.request.op.stream:
                self.streamed.setdefault(row.request.ticket, []).append(row.last_token())
            if not finished:
                still.append(b)
            else:
                row.request.unfinished -= 1
                if row.request.unfinished == 0:
                    self._finish(row.request, done, None)
        if len(still) < len(rows):
            self.cache.keep(still)
            self.rows = [rows[b] for b in still]
            self.rules = self.rules.select(still) if still else None
            tokens = tokens[still]
        if not self.rows:
            self.hidden = None
            return
        positions, mask = self.cache.step_inputs()
        if self.vision is not None:
            positions = self._mrope_positions(positions)
        self._set_routing([r.slot for r in self.rows])
        if self.fused is not None:
            adapters = any(row.slot != BASE_SLOT for row in self.rows)
            hidden = self.fused(tokens, positions, mask, self.cache, adapters=adapters)
        else:
            if self.window is not None:
                mask = window_masks(mask, self.cache.width, self.window, self.hidden.dtype,
                                    additive=self.text_config._attn_implementation in ("eager", GROUPED["eager"]))
            out = self.body(
                input_ids=tokens[:, None], attention_mask=mask, position_ids=positions, cache=self.cache, use_cache=True
            )
            hidden = out.last_hidden_state[:, -1]
        self.cache.advance()
        self.hidden = hidden  # [B, H]

    def _with_images(self, prefill: Prefill, op: SampleOp) -> None:
        """Give an image prompt's prefill the VLM body and its inputs (pixels, M-RoPE positions);
        the prompt is then prefilled whole in one forward, so the tower runs once per request."""
        if self.vision is None:
            raise UserError(f"base model {self.rt.name!r} is a text-only model and takes no images")
        extra = self.vision.inputs(prefill.prompt[None], None, [op.images])
        prefill.rope_delta = int(extra.pop("rope_deltas")[0])
        prefill.images = extra
        prefill.vlm_body = self.rt.model.model

    def _mrope_positions(self, positions: torch.Tensor) -> torch.Tensor:
        """[B, 1] cache positions -> [4, B, 1]: the text position (the causal mask's) and the three
        M-RoPE axes, each the text position plus the row's image offset (0 for a text-only prompt),
        as HF's generate continues from `rope_deltas`."""
        delta = torch.tensor([row.request.prefill.rope_delta for row in self.rows], dtype=positions.dtype,
                             device=positions.device)[:, None]
        shifted = positions + delta
        return torch.stack([positions, shifted, shifted, shifted])

    def _record_topk(self, rows: list[Row], logprobs: torch.Tensor) -> None:
        want = [b for b, r in enumerate(rows) if r.topk > 0]
        if not want:
            return
        idx = torch.tensor(want, device=logprobs.device)
        k = max(rows[b].topk for b in want)
        vals, ids = torch.topk(logprobs[idx], k, dim=-1)  # [b, K] best-first
        vals = vals.cpu().numpy()
        ids = ids.cpu().numpy()
        for j, b in enumerate(want):
            kk = rows[b].topk
            rows[b].topk_ids.append(ids[j, :kk])
            rows[b].topk_logprobs.append(vals[j, :kk])

    def take_streamed(self) -> list[tuple[str, list[TokenDelta]]]:
        """The streaming requests' tokens since the last call (StepOutput.partial), and forget them."""
        out, self.streamed = list(self.streamed.items()), {}
        return out

    # -- cancellation ----------------------------------------------------------------------------

    def cancel(self, ticket: str) -> list[tuple[str, object]]:
        """Stop a request wherever it is (prefilling or decoding): its rows leave the batch and its
        KV cache, and it finishes failed as cancelled. [] when this sampler does not hold it."""
        done: list[tuple[str, object]] = []
        error = UserError("cancelled by the client (cancel_future)")
        for req in self.joining:
            if req.ticket == ticket:
                self.joining.remove(req)
                req.prefill.cache = None
                self._finish(req, done, error)
                return done
        mine = [row.request for row in self.rows if row.request.ticket == ticket]
        if not mine:
            return done
        mine[0].unfinished = 0
        self._finish(mine[0], done, error)
        keep = [b for b, row in enumerate(self.rows) if row.request.ticket != ticket]
        if keep:
            self.cache.keep(keep)
            self.rows = [self.rows[b] for b in keep]
            self.rules = self.rules.select(keep)
            self.hidden = self.hidden[torch.tensor(keep, dtype=torch.long)]
        else:
            self.rows, self.rules, self.hidden = [], None, None
            self.cache = self._new_cache()
        return done

    # -- completion ------------------------------------------------------------------------------

    def _finish(self, req: Request, done: list, error: TinkerdError | None) -> None:
        self._release(req.adapter)
        req.adapter = None
        done.append((req.ticket, error if error is not None else req.result()))
        log.debug(
            "sample %s: %d prompt tokens, %d rows, %d generated tokens in %.3f s", req.ticket,
            req.prefill.prompt.shape[0], len(req.rows), sum(len(r.tokens) for r in req.rows),
            time.perf_counter() - req.admitted_at,
        )

    def _fail_batch(self, done: list, error: TinkerdError) -> None:
        """Fail every request with rows in the decode batch and start an empty batch."""
        failed = {id(r.request): r.request for r in self.rows if r.request.unfinished > 0}
        for req in failed.values():
            req.unfinished = 0
            self._finish(req, done, error)
        self.rows, self.rules, self.hidden = [], None, None
        self.cache = self._new_cache()

    def _release(self, adapter: Adapter | None) -> None:
        if adapter is not None:
            self.rt.pool.release(adapter)

    # -- adapter routing -------------------------------------------------------------------------

    def _set_routing(self, slots: list[int]) -> None:
        """Route batch row i to adapter slot slots[i]; memoised while the batch does not change."""
        key = tuple(slots)
        if self._routing is None or self._routing[0] != key:
            self.rt.ctx.set_rows(slots)
            self._routing = (key, self.rt.ctx.groups)
        self.rt.ctx.groups = self._routing[1]

    @contextlib.contextmanager
    def _sampling_mode(self):
        self.rt.ctx.sampling = True
        try:
            yield
        finally:
            self.rt.ctx.sampling = False
            self.rt.ctx.clear()


def run_sample(engine: Engine, op: SampleOp, config: SamplerConfig | None = None) -> SampleResult:
    """One request alone, start to finish, through a fresh decode batch: the synchronous form.

    The reference the fused batch is tested against, and what `Engine.step(list)` runs for a
    SampleOp. Raises what the request failed with.
    """
    runtime = engine.runtime(op.base_model)
    sampler = Sampler(runtime, config or engine.sampler_config)
    sampler.admit("run_sample", op)
    while True:
        for _, result in sampler.step():
            if isinstance(result, TinkerdError):
                raise result
            return result


def _decoder(runtime: ModelRuntime):
    tokenizer = runtime.tokenizer

    def decode(ids: list[int]) -> str:
        # Special tokens are kept so a stop string like "<|im_end|>" matches its token.
        return tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)

    return decode
