"""The checks a forward_backward's datums pass before anything runs (engine/training.py).

Each one names the datum and the problem as a UserError: a caller's mistake is a 4xx, and it fails
only its own op (several runs' ops in one pass, engine/cotrain.py, each validate alone first).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from tinkerd.engine.losses import LossFn
from tinkerd.errors import UserError
from tinkerd.types import Datum

if TYPE_CHECKING:
    from tinkerd.engine.engine import ModelRuntime


def validate_datum(i: int, datum: Datum, loss: LossFn, vocab_size: int, max_context: int) -> dict[str, np.ndarray]:
    """Check one datum; returns its loss inputs converted (target_tokens int64, the rest fp32)."""
    tokens = np.asarray(datum.tokens)
    if tokens.ndim != 1 or tokens.size == 0:
        raise UserError(f"datum {i}: model_input must be a non-empty 1-D token list, got shape {list(tokens.shape)}")
    if not np.issubdtype(tokens.dtype, np.integer):
        raise UserError(f"datum {i}: model_input tokens must be integers, got {tokens.dtype}")
    n = tokens.shape[0]
    if n > max_context:
        raise UserError(f"datum {i}: {n} tokens exceed the model's context length of {max_context}")
    bad = (tokens < 0) | (tokens >= vocab_size)
    if bad.any():
        raise UserError(f"datum {i}: token id {int(tokens[bad][0])} is outside the vocabulary [0, {vocab_size})")

    given = datum.loss_fn_inputs
    missing = [k for k in loss.required_inputs if k not in given]
    if missing:
        raise UserError(f"datum {i}: loss_fn {loss.name} requires loss_fn_inputs {missing}")
    unknown = sorted(set(given) - set(loss.accepted_inputs))
    if unknown:
        accepted = ", ".join(loss.accepted_inputs)
        raise UserError(f"datum {i}: loss_fn_inputs {unknown} are not used by {loss.name} (accepted: {accepted})")
    targets = np.asarray(given["target_tokens"])
    if targets.ndim not in (1, 2) or targets.shape[0] != n or (targets.ndim == 2 and targets.shape[1] == 0):
        raise UserError(
            f"datum {i}: target_tokens has shape {list(targets.shape)}; expected [{n}] or [{n}, K] to match {n} input tokens"
        )
    if not np.issubdtype(targets.dtype, np.integer):
        raise UserError(f"datum {i}: target_tokens must be integers, got {targets.dtype}")
    bad = (targets < 0) | (targets >= vocab_size)
    if bad.any():
        token = int(targets[bad][0])
        raise UserError(f"datum {i}: target token id {token} is outside the vocabulary [0, {vocab_size})")

    out = {"target_tokens": targets.astype(np.int64, copy=False)}
    for key, value in given.items():
        if key == "target_tokens":
            continue
        arr = np.asarray(value)
        # Every registered loss aligns its inputs with the targets position by position.
        if arr.shape != targets.shape:
            raise UserError(f"datum {i}: {key} has shape {list(arr.shape)} but target_tokens has {list(targets.shape)}")
        if not (np.issubdtype(arr.dtype, np.number) or arr.dtype == np.bool_):
            raise UserError(f"datum {i}: {key} must be numeric, got {arr.dtype}")
        arr = arr.astype(np.float32, copy=False)
        if not np.isfinite(arr).all():
            raise UserError(f"datum {i}: {key} contains NaN or infinite values")
        out[key] = arr
    if loss.recorded_input is not None:
        # The server's record, resolved from the datum's provenance by control/stability.py; NaN
        # marks the positions that are not sampled tokens, so no finiteness check here.
        recorded = datum.sampler_logprobs
        if recorded is None:
            raise UserError(f"datum {i}: loss_fn {loss.name} needs provenance naming the sampled sequences "
                            "(Datum.with_provenance with sequence_ids from a record_stability_info sampler)")
        recorded = np.asarray(recorded, dtype=np.float32)
        if recorded.shape != (n,) or targets.ndim != 1:
            raise UserError(f"datum {i}: {loss.name} needs 1-D target_tokens of length {n} "
                            f"(got {list(targets.shape)}) covered by recorded log-probs of shape [{n}]")
        out[loss.recorded_input] = recorded
    return out


def validate(data: list[Datum], rt: "ModelRuntime", loss: LossFn) -> list[dict[str, np.ndarray]]:
    if not data:
        raise UserError("forward_backward needs at least one datum")
    vocab_size, max_context = rt.vocab_size, rt.loaded.max_context_length
    inputs = [validate_datum(i, d, loss, vocab_size, max_context) for i, d in enumerate(data)]
    # The loss sees all positions concatenated, so every datum must share the trailing target shape.
    trailing = inputs[0]["target_tokens"].shape[1:]
    for i, x in enumerate(inputs):
        if x["target_tokens"].shape[1:] != trailing:
            raise UserError(
                f"datum {i}: target_tokens trailing shape {list(x['target_tokens'].shape[1:])} differs from "
                f"datum 0's {list(trailing)}; one request must use one target shape"
            )
        present = sorted(k for k in x if k in loss.optional_inputs)
        first = sorted(k for k in inputs[0] if k in loss.optional_inputs)
        if present != first:
            raise UserError(
                f"datum {i}: loss_fn_inputs {present} differ from datum 0's {first}; send the same keys on every datum"
            )
    return inputs
