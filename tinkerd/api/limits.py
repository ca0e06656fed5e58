"""Bounds on the numbers a request carries, checked where the request is decoded.

Two reasons a number is refused, both as a UserError (400, category `user`) naming the field:

- It does not fit where it goes. seq_id, model_seq_id and offsets land in SQLite INTEGER columns
  and LoRA / sampling seeds in torch.Generator, all int64: 2^63 reached SQLite and came back as an
  OverflowError (a 500, which the SDK retries for minutes). Token ids travel as int32 (protobuf's
  EncodedTextChunk.tokens), and numpy raised OverflowError on a JSON prompt token of 2^63.
- It means nothing. A negative seq_id, an eps of 0 (Adam divides by sqrt(v) + eps, and v is 0 for
  every LoRA B gradient at the first step: 0/0 = NaN), a learning_rate of inf: each "succeeded"
  and left every later forward at loss=nan.

The engine's own checks (engine/training.py, engine/sampler/rules.py: the vocabulary, the context
length, loss_fn_config) stay where they are, as does its last line against non-finite results.

Ops already in the write-ahead log as complete are rebuilt without these checks (api/legacy.py,
`logged=True`): they ran, and the adapter's state is a function of them. Pending ones are checked.
"""

from __future__ import annotations

import math

from tinker import types as t

from tinkerd.errors import UserError

INT64_MAX = 2**63 - 1
INT64_MIN = -(2**63)
# The wire's token type: EncodedTextChunk.tokens is a packed int32 buffer in protobuf.
TOKEN_ID_MAX = 2**31 - 1


def integer(value: int | None, field: str, lo: int = 0, hi: int = INT64_MAX) -> None:
    """`value` in [lo, hi] (None passes: the field is optional). Defaults: a count or an id, >= 0."""
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise UserError(f"{field} must be an integer, got {value!r}")
    if not lo <= value <= hi:
        raise UserError(f"{field} must be between {lo} and {hi}, got {value}")


def seq_id(value: int | None, field: str = "seq_id") -> None:
    integer(value, field)


def real(value: float, field: str, lo: float, hi: float = math.inf, *, lo_open: bool = False,
         hi_open: bool = False) -> None:
    """`value` finite and within lo..hi (each end closed unless `*_open`)."""
    v = float(value)
    if not math.isfinite(v):
        raise UserError(f"{field} must be a finite number, got {v}")
    if v < lo or (lo_open and v == lo) or v > hi or (hi_open and v == hi):
        left, right = "(" if lo_open else "[", ")" if hi_open or hi == math.inf else "]"
        raise UserError(f"{field} must be in {left}{lo}, {hi}{right}, got {v}")


def adam_params(p: t.AdamParams) -> None:
    real(p.learning_rate, "adam_params.learning_rate", 0.0)
    real(p.beta1, "adam_params.beta1", 0.0, 1.0, hi_open=True)
    real(p.beta2, "adam_params.beta2", 0.0, 1.0, hi_open=True)
    real(p.eps, "adam_params.eps", 0.0, lo_open=True)
    real(p.weight_decay, "adam_params.weight_decay", 0.0)
    real(p.grad_clip_norm, "adam_params.grad_clip_norm", 0.0)
    # Decoupled decay multiplies every weight by 1 - lr * weight_decay: above 1 that flips their
    # signs and grows them each step (weight_decay=1e300 made it -1e296, inf in fp32). Typical
    # values are lr 1e-4 and weight_decay 0.01-0.1, a product of 1e-5.
    if p.learning_rate * p.weight_decay > 1.0:
        raise UserError(f"adam_params.learning_rate * adam_params.weight_decay must be <= 1 (the decay factor "
                        f"1 - lr * weight_decay must stay in [0, 1]), got {p.learning_rate * p.weight_decay:g}")


def token_ids(tokens, field: str) -> None:
    """Within int32 and >= 0; the engine checks the model's own vocabulary (rules.validate)."""
    for tok in tokens:
        if isinstance(tok, bool) or not isinstance(tok, int) or not 0 <= tok <= TOKEN_ID_MAX:
            raise UserError(f"{field} {tok!r} is outside the vocabulary: token ids are integers in [0, {TOKEN_ID_MAX}]")


def sampling_params(p: t.SamplingParams, max_context_length: int) -> None:
    # The prompt plus max_tokens must fit the context (engine/sampler/rules.py checks the sum).
    if p.max_tokens is not None and not 1 <= p.max_tokens <= max_context_length:
        raise UserError(f"sampling_params.max_tokens must be between 1 and the model's context length of "
                        f"{max_context_length}, got {p.max_tokens}")
    integer(p.seed, "sampling_params.seed", INT64_MIN, INT64_MAX)
    # -1 and 0 are "off"; a k above the vocabulary is clamped to it (rules.choose_tokens).
    integer(p.top_k, "sampling_params.top_k", -1, INT64_MAX)
    real(p.temperature, "sampling_params.temperature", 0.0)
    real(p.top_p, "sampling_params.top_p", 0.0, 1.0, lo_open=True)
    if p.stop is not None and not isinstance(p.stop, str):
        for s in p.stop:
            if isinstance(s, int):
                token_ids([s], "sampling_params.stop token id")


def sample_request(req: t.SampleRequest, max_context_length: int) -> None:
    seq_id(req.seq_id)
    for chunk in req.prompt.chunks:
        if chunk.type == "encoded_text":
            token_ids(chunk.tokens, "prompt token id")
    sampling_params(req.sampling_params, max_context_length)
    integer(req.topk_prompt_logprobs, "topk_prompt_logprobs")
    integer(req.topk_sample_logprobs, "topk_sample_logprobs")
    integer(req.prompt_logprobs_last_n, "prompt_logprobs_last_n", 1)


# The engine checks lengths against the base model's own context (engine/training.py,
# engine/sampler/rules.py). A long-context id (`<base>:peft:<tokens>`, api/deps.py served_model)
# names a lower limit for the same base, which only this layer knows: checked here, in the same words.

def sample_context(prompt_tokens: int, max_tokens: int, max_context_length: int) -> None:
    if prompt_tokens + max_tokens > max_context_length:
        raise UserError(f"prompt ({prompt_tokens} tokens) + max_tokens ({max_tokens}) exceeds the model's context "
                        f"length of {max_context_length}")


def datum_lengths(data, max_context_length: int) -> None:
    for i, datum in enumerate(data):
        if len(datum.tokens) > max_context_length:
            raise UserError(f"datum {i}: {len(datum.tokens)} tokens exceed the model's context length of "
                            f"{max_context_length}")
