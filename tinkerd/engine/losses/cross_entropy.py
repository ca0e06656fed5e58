"""`cross_entropy`: −Σ logprob(target) · weight, a sum over every target position (protocol §8).

Weights may be any sign (negative weights push a token down, as the cookbook's preference
recipes do) and default to ones when the datum sends none. Soft targets: `target_tokens` [M, K]
with `weights` [M, K] sum over both axes, each (position, candidate) pair weighted on its own.
"""

from __future__ import annotations

import torch
from torch import Tensor

NAME = "cross_entropy"
REQUIRED_INPUTS = ("target_tokens",)
OPTIONAL_INPUTS = ("weights",)
CONFIG_DEFAULTS: dict[str, float | str] = {}


def loss_fn(
    target_logprobs: Tensor, inputs: dict[str, Tensor], config: dict[str, float | str]
) -> tuple[Tensor, dict[str, float]]:
    # target_logprobs [M] or [M, K]; weights the same shape (the engine checked it per datum).
    weights = inputs.get("weights")
    if weights is None:
        weights = torch.ones_like(target_logprobs)
    loss_sum = -(target_logprobs * weights).sum()
    return loss_sum, {"loss:sum": float(loss_sum.detach())}
