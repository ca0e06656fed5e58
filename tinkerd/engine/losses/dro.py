"""`dro`: −Σ (lp·A − ½·β·(lp − q)²) (protocol §8, the public Tinker docs).

The quadratic term keeps the learner near the sampler; the advantages are expected to be DRO's
soft estimate, computed client-side. β comes from loss_fn_config and has no default here: the docs
show it only as a caller's value (0.05 in their example), and a guessed default would change results.
d loss / d lp = −A + β·(lp − q).
"""

from __future__ import annotations

from torch import Tensor

from tinkerd.engine.losses.params import number

NAME = "dro"
REQUIRED_INPUTS = ("target_tokens", "logprobs", "advantages")
OPTIONAL_INPUTS = ()
CONFIG_DEFAULTS: dict[str, float | str | None] = {"beta": None}


def loss_fn(
    target_logprobs: Tensor, inputs: dict[str, Tensor], config: dict[str, float | str]
) -> tuple[Tensor, dict[str, float]]:
    beta = number(config, "beta", NAME)
    objective = target_logprobs * inputs["advantages"] - 0.5 * beta * (target_logprobs - inputs["logprobs"]) ** 2
    loss_sum = -objective.sum()
    return loss_sum, {"loss:sum": float(loss_sum.detach())}
