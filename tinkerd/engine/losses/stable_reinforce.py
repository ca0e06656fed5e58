"""`stable_reinforce`: REINFORCE with masked token-level importance weights against the sampler's
own recorded log-probs, plus an optional sampler-to-learner KL term (docs/losses.md).

The hosted objective is not published; this is tinkerd's, from the off-policy RL literature (masked /
truncated importance sampling for the training-inference mismatch). Per target position t that is a
sampled token (a SampledProvenanceSpan position), with lp the learner's log-prob, q the log-prob
the sampler recorded when it sampled the token (never the client's copy), r = exp(lp − q) and A
the advantage:

    m_t  = 1 if ratio_low <= r_t <= ratio_high else 0          (detached: a token mask)
    loss = −Σ_t m_t · r_t · A_t  +  kl_coeff · Σ_t (r_t − 1 − log r_t)

so d loss / d lp_t = −m_t·r_t·A_t + kl_coeff·(r_t − 1). The first term is importance_sampling with
the tokens the sampler and learner disagree about by more than the bounds dropped, instead of
letting one such token's ratio dominate the step; on-policy (r = 1) it is plain REINFORCE, −A. The
second is Schulman's k3 estimator of KL(sampler ‖ learner) from sampler draws: non-negative, zero
on-policy, with slope r − 1 pulling the learner back towards the sampler.

Positions that are not sampled tokens (prompt targets) carry no loss; a non-zero advantage there
is refused (the cookbook's rl/train.py says so too) rather than silently dropped.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

from tinkerd.engine.losses.params import DATUM_INDEX
from tinkerd.errors import UserError
from tinkerd.types import StableReinforceConfig

NAME = "stable_reinforce"
REQUIRED_INPUTS = ("target_tokens", "advantages")
# The client's copy of the sampler log-probs, which the cookbook sends: accepted and not used.
OPTIONAL_INPUTS = ("logprobs",)
CONFIG_DEFAULTS: dict[str, float | str | None] = dataclasses.asdict(StableReinforceConfig())
# The engine adds this input from Datum.sampler_logprobs (the server's record): [M] fp32, NaN at
# positions that are not sampled tokens. A client cannot send it: it is not an accepted input.
RECORDED_INPUT = "sampler_logprobs"


def loss_fn(
    target_logprobs: Tensor, inputs: dict[str, Tensor], config: dict[str, float | str]
) -> tuple[Tensor, dict[str, float]]:
    if target_logprobs.dim() != 1:
        raise UserError("stable_reinforce needs 1-D target_tokens (one sampled token per position)")
    cfg = StableReinforceConfig.parse(config)
    recorded = inputs[RECORDED_INPUT]
    sampled = ~torch.isnan(recorded)  # [M]
    advantages = inputs["advantages"]
    stray = (advantages != 0) & ~sampled
    if bool(stray.any()):
        where = int(torch.nonzero(stray)[0])
        datum = int(inputs[DATUM_INDEX][where]) if DATUM_INDEX in inputs else 0
        raise UserError(f"datum {datum}: stable_reinforce takes advantages only on sampled tokens, but a target "
                        f"under a PromptProvenanceSpan has advantage {float(advantages[where])}")
    keep = sampled.to(target_logprobs.dtype)
    q = torch.where(sampled, recorded, torch.zeros_like(recorded)).to(target_logprobs.dtype)
    # Off sampled positions lp − q is replaced by 0 before exp: r = 1 there, and masked out below.
    log_r = torch.where(sampled, target_logprobs - q, torch.zeros_like(target_logprobs))
    r = torch.exp(log_r)
    r_value = r.detach()
    mask = ((r_value >= cfg.ratio_low) & (r_value <= cfg.ratio_high)).to(r.dtype) * keep
    policy = -(mask * r * advantages).sum()
    kl = ((r - 1 - log_r) * keep).sum()
    loss_sum = policy + cfg.kl_coeff * kl
    return loss_sum, {
        "loss:sum": float(loss_sum.detach()),
        # Counts and sums only, so the SDK's merge of chunks (":sum" added) stays exact.
        "sampled_tokens:sum": float(keep.sum()),
        "masked_tokens:sum": float((keep - mask).sum()),
        "kl_sampler_learner:sum": float(kl.detach()),
    }
