"""`importance_sampling`: −Σ r·A with r = exp(lp − q), the off-policy-corrected REINFORCE loss.

q (`logprobs`) are the sampler's log-probs of the sampled tokens, A (`advantages`) the client's
per-token advantages; padding positions carry A = 0 and so contribute nothing (protocol §8).
d loss / d lp = −r·A: on-policy (lp = q) this is plain REINFORCE, −A.
"""

from __future__ import annotations

from torch import Tensor

from tinkerd.engine.losses.params import ratio

NAME = "importance_sampling"
REQUIRED_INPUTS = ("target_tokens", "logprobs", "advantages")
OPTIONAL_INPUTS = ()
CONFIG_DEFAULTS: dict[str, float | str | None] = {}


def loss_fn(
    target_logprobs: Tensor, inputs: dict[str, Tensor], config: dict[str, float | str]
) -> tuple[Tensor, dict[str, float]]:
    loss_sum = -(ratio(target_logprobs, inputs) * inputs["advantages"]).sum()
    return loss_sum, {"loss:sum": float(loss_sum.detach())}
