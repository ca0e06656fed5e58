"""`gspo`: GSPO-token, as the public Tinker docs define it (their GSPO page, not the SDK).

Per datum, the sequence log-ratio is the mean of (lp − q) over the positions `sequence_ratio_mask`
marks (non-zero); every position's ratio takes that value with its own log-prob's gradient,
s_t = exp(sg(mean) + lp_t − sg(lp_t)), and is clipped PPO-style:
    loss = −Σ_t min(s_t·A_t, clip(s_t, lo, hi)·A_t)
So d loss / d lp_t = −s·A_t where the unclipped term is the min, else 0. The sequence is the datum
("everything the loss needs is in the Datum"), which is why the engine passes DATUM_INDEX.

The thresholds default to PPO's 0.8 / 1.2: the docs page's own defaults could not be read when this
was written (the GSPO paper used far tighter ones, 3e-4 / 4e-4 around 1). The cookbook's rl_loop
sends gspo without a config, so a default is needed; callers who care pass loss_fn_config.
"""

from __future__ import annotations

import torch
from torch import Tensor

from tinkerd.engine.losses.params import CLIP_DEFAULTS, DATUM_INDEX, clip_bounds, clipped_away
from tinkerd.errors import UserError

NAME = "gspo"
REQUIRED_INPUTS = ("target_tokens", "logprobs", "advantages", "sequence_ratio_mask")
OPTIONAL_INPUTS = ("clip_low_threshold", "clip_high_threshold")
CONFIG_DEFAULTS: dict[str, float | str | None] = dict(CLIP_DEFAULTS)


def loss_fn(
    target_logprobs: Tensor, inputs: dict[str, Tensor], config: dict[str, float | str]
) -> tuple[Tensor, dict[str, float]]:
    if target_logprobs.dim() != 1:
        raise UserError("gspo needs 1-D target_tokens (one sampled token per position)")
    lo, hi = clip_bounds(inputs, config, NAME)
    advantages = inputs["advantages"]
    datum = inputs[DATUM_INDEX]  # [M]
    in_ratio = (inputs["sequence_ratio_mask"] != 0).to(target_logprobs.dtype)  # [M]
    num_datums = int(datum.max()) + 1
    counts = target_logprobs.new_zeros(num_datums).index_add_(0, datum, in_ratio)  # [B]
    if bool((counts == 0).any()):
        empty = int(torch.nonzero(counts == 0)[0])
        raise UserError(f"datum {empty}: gspo's sequence_ratio_mask marks no position, so it has no sequence ratio")
    log_ratio = (target_logprobs.detach() - inputs["logprobs"]) * in_ratio
    seq_log_ratio = target_logprobs.new_zeros(num_datums).index_add_(0, datum, log_ratio) / counts  # [B]
    s = torch.exp(seq_log_ratio[datum] + target_logprobs - target_logprobs.detach())  # value s, grad via lp_t
    objective = torch.minimum(s * advantages, torch.clamp(s, lo, hi) * advantages)
    loss_sum = -objective.sum()
    clipped = clipped_away(s, advantages, lo, hi)
    return loss_sum, {"loss:sum": float(loss_sum.detach()), "clipped_tokens:sum": float(clipped.sum())}
