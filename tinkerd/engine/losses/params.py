"""What the policy-gradient losses share: reading their config, and the sampler ratio.

Notation (protocol §8): lp = learner log-prob of the target (the loss's input), q = sampler
log-prob (input `logprobs`), A = `advantages`, r = exp(lp − q).
"""

from __future__ import annotations

import torch
from torch import Tensor

from tinkerd.errors import UserError

# The engine adds this key to every loss's inputs: [M] int64, which datum each position came from.
DATUM_INDEX = "datum_index"

# The public Tinker docs: PPO's ε is "currently fixed to 0.2", i.e. ratio thresholds 0.8 / 1.2.
CLIP_DEFAULTS: dict[str, float | str | None] = {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}


def number(config: dict[str, float | str], key: str, loss: str) -> float:
    value = config[key]
    if isinstance(value, str):
        raise UserError(f"loss_fn_config[{key!r}] for {loss} must be a number, got the string {value!r}")
    value = float(value)
    if value != value or value in (float("inf"), float("-inf")):
        raise UserError(f"loss_fn_config[{key!r}] for {loss} must be finite, got {value}")
    return value


def clip_bounds(inputs: dict[str, Tensor], config: dict[str, float | str], loss: str) -> tuple[Tensor, Tensor]:
    """The ratio thresholds: per position when the datum sends them (the SDK knows
    `clip_low_threshold` / `clip_high_threshold` as loss_fn_inputs keys), else the config scalars.
    Returned as tensors broadcastable against the positions."""
    lo = inputs.get("clip_low_threshold")
    hi = inputs.get("clip_high_threshold")
    # On the positions' device: torch.clamp takes a CPU scalar tensor as a bound only on the CPU.
    device = inputs["logprobs"].device
    if lo is None:
        lo = torch.tensor(number(config, "clip_low_threshold", loss), device=device)
    if hi is None:
        hi = torch.tensor(number(config, "clip_high_threshold", loss), device=device)
    if bool((lo < 0).any()) or bool((lo > hi).any()):
        raise UserError(
            f"{loss} needs 0 <= clip_low_threshold <= clip_high_threshold (they are ratios, e.g. 0.8 and 1.2)"
        )
    return lo, hi


def ratio(target_logprobs: Tensor, inputs: dict[str, Tensor]) -> Tensor:
    """r = exp(lp − q), differentiable through lp."""
    return torch.exp(target_logprobs - inputs["logprobs"])


def clipped_away(r: Tensor, advantages: Tensor, lo: Tensor, hi: Tensor) -> Tensor:
    """Positions where PPO's min picks the clipped term and so passes no gradient:
    A > 0 with r above hi, or A < 0 with r below lo."""
    r = r.detach()
    return ((advantages > 0) & (r > hi)) | ((advantages < 0) & (r < lo))
