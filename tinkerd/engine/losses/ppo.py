"""`ppo`: −Σ min(r·A, clip(r, lo, hi)·A), token by token (protocol §8, the public Tinker docs).

lo / hi are ratio thresholds (0.8 / 1.2 by default, ε = 0.2), from loss_fn_config or per position
from loss_fn_inputs. Where the min picks the clipped term the token passes no gradient; that count
is reported as `clipped_tokens:sum` (a count, so the SDK's sum over chunks stays exact).
"""

from __future__ import annotations

import torch
from torch import Tensor

from tinkerd.engine.losses.params import CLIP_DEFAULTS, clip_bounds, clipped_away, ratio

NAME = "ppo"
REQUIRED_INPUTS = ("target_tokens", "logprobs", "advantages")
OPTIONAL_INPUTS = ("clip_low_threshold", "clip_high_threshold")
CONFIG_DEFAULTS: dict[str, float | str | None] = dict(CLIP_DEFAULTS)


def loss_fn(
    target_logprobs: Tensor, inputs: dict[str, Tensor], config: dict[str, float | str]
) -> tuple[Tensor, dict[str, float]]:
    lo, hi = clip_bounds(inputs, config, NAME)
    advantages = inputs["advantages"]
    r = ratio(target_logprobs, inputs)
    objective = torch.minimum(r * advantages, torch.clamp(r, lo, hi) * advantages)
    loss_sum = -objective.sum()
    clipped = clipped_away(r, advantages, lo, hi)
    return loss_sum, {"loss:sum": float(loss_sum.detach()), "clipped_tokens:sum": float(clipped.sum())}
