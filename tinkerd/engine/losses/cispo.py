"""`cispo`: −Σ sg(clip(r, lo, hi))·lp·A (protocol §8, the public Tinker docs).

Unlike PPO the clipped ratio is only a detached weight on the log-prob's gradient, so every token
keeps a gradient (d loss / d lp = −clip(r)·A). `clipped_tokens:sum` counts the positions with
A ≠ 0 whose ratio was clamped.
"""

from __future__ import annotations

import torch
from torch import Tensor

from tinkerd.engine.losses.params import CLIP_DEFAULTS, clip_bounds, ratio

NAME = "cispo"
REQUIRED_INPUTS = ("target_tokens", "logprobs", "advantages")
OPTIONAL_INPUTS = ("clip_low_threshold", "clip_high_threshold")
CONFIG_DEFAULTS: dict[str, float | str | None] = dict(CLIP_DEFAULTS)


def loss_fn(
    target_logprobs: Tensor, inputs: dict[str, Tensor], config: dict[str, float | str]
) -> tuple[Tensor, dict[str, float]]:
    lo, hi = clip_bounds(inputs, config, NAME)
    advantages = inputs["advantages"]
    r = ratio(target_logprobs, inputs).detach()
    weight = torch.clamp(r, lo, hi)
    loss_sum = -(weight * target_logprobs * advantages).sum()
    clipped = ((r < lo) | (r > hi)) & (advantages != 0)
    return loss_sum, {"loss:sum": float(loss_sum.detach()), "clipped_tokens:sum": float(clipped.sum())}
