"""Loss functions, registered by their protocol name (`loss_fn` in forward_backward).

Every loss is one module exporting the same five names (and, for stable_reinforce, RECORDED_INPUT:
an input the engine fills from Datum.sampler_logprobs, the server's record of the sampler):

    NAME             the protocol name, verbatim (`cross_entropy`, `importance_sampling`, ...)
    REQUIRED_INPUTS  loss_fn_inputs keys that must be present on every datum
    OPTIONAL_INPUTS  keys the loss accepts but can do without (it fills the default itself)
    CONFIG_DEFAULTS  the accepted loss_fn_config keys and their defaults; None = the caller must
                     send it (no published default to copy, and guessing one would change results)
    loss_fn(target_logprobs, inputs, config) -> (loss_sum, metrics)

and is added here with one line in `_MODULES`. The engine (training.py) does the rest: it
validates inputs per datum against the declared keys (so errors can name the datum), computes
the learner's log-probs of `target_tokens`, and concatenates every datum's positions in datum
order before calling the loss once:

    target_logprobs  [M] or [M, K] fp32, M = total target positions of the batch (no padding rows,
                     so a loss never has to mask), differentiable unless forward_only
    inputs           key -> tensor with the same leading M: `target_tokens` int64, others fp32;
                     plus DATUM_INDEX [M] int64, the datum each position belongs to, for losses
                     that aggregate per sequence (gspo)
    config           CONFIG_DEFAULTS updated with the request's loss_fn_config
    loss_sum         scalar; Tinker losses are sums over tokens, never means (protocol §8)
    metrics          `name:reduction` keys (protocol §7.6); at least `loss:sum`. The SDK merges
                     chunks by suffix (`:sum` added, `:mean` datum-weighted), so a metric must be
                     exact under that merge: counts are `:sum`, never per-chunk token fractions.

A loss must be a function of the target log-probs alone: the engine splits the backward at them.
An unknown name is a UserError listing the supported ones; there is no fallback loss.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import ModuleType

from torch import Tensor

from tinkerd.engine.losses import cispo, cross_entropy, dro, gspo, importance_sampling, ppo, stable_reinforce
from tinkerd.engine.losses.params import DATUM_INDEX
from tinkerd.errors import UserError

__all__ = ["DATUM_INDEX", "LOSSES", "LossFn", "get_loss", "supported_losses"]

LossImpl = Callable[[Tensor, dict[str, Tensor], dict[str, float | str]], tuple[Tensor, dict[str, float]]]

# Adding a loss family: write losses/<family>.py with the five names above and list it here.
_MODULES: tuple[ModuleType, ...] = (cross_entropy, importance_sampling, ppo, cispo, dro, gspo, stable_reinforce)

# Names the SDK's LossFnType knows that tinkerd refuses on purpose, with the reason the caller needs.
_REFUSED = {
    "custom": (
        "it runs a loss uploaded with create_custom_loss and needs that loss's id as "
        "loss_fn_config['loss_id'] (engine/losses/custom.py)"
    ),
}


@dataclass(frozen=True)
class LossFn:
    """A registered loss: the pure function plus what it accepts, so the engine can validate."""

    name: str
    fn: LossImpl
    required_inputs: tuple[str, ...]
    optional_inputs: tuple[str, ...] = ()
    config_defaults: Mapping[str, float | str | None] = field(default_factory=dict)
    # An input the server fills from its own records (Datum.sampler_logprobs), never the client:
    # stable_reinforce's RECORDED_INPUT. None for losses that need only what the datum carries.
    recorded_input: str | None = None

    @property
    def accepted_inputs(self) -> tuple[str, ...]:
        return self.required_inputs + self.optional_inputs

    def resolve_config(self, config: Mapping[str, float | str]) -> dict[str, float | str]:
        """The loss's defaults updated with the request's values; unknown keys are the caller's mistake."""
        unknown = sorted(set(config) - set(self.config_defaults))
        if unknown:
            accepted = ", ".join(sorted(self.config_defaults)) or "none"
            raise UserError(f"loss_fn_config keys {unknown} are not used by {self.name} (accepted: {accepted})")
        resolved = {**self.config_defaults, **config}
        missing = sorted(k for k, v in resolved.items() if v is None)
        if missing:
            raise UserError(f"loss_fn {self.name} needs loss_fn_config {missing}; it has no default value")
        return resolved

    def __call__(
        self, target_logprobs: Tensor, inputs: dict[str, Tensor], config: dict[str, float | str]
    ) -> tuple[Tensor, dict[str, float]]:
        return self.fn(target_logprobs, inputs, config)


def _from_module(module: ModuleType) -> LossFn:
    return LossFn(
        name=module.NAME,
        fn=module.loss_fn,
        required_inputs=tuple(module.REQUIRED_INPUTS),
        optional_inputs=tuple(module.OPTIONAL_INPUTS),
        config_defaults=dict(module.CONFIG_DEFAULTS),
        recorded_input=getattr(module, "RECORDED_INPUT", None),
    )


LOSSES: dict[str, LossFn] = {m.NAME: _from_module(m) for m in _MODULES}


def supported_losses() -> list[str]:
    """The names get_server_capabilities advertises; `custom` runs an uploaded loss (custom.py)."""
    return sorted([*LOSSES, "custom"])


def get_loss(name: str) -> LossFn:
    loss = LOSSES.get(name)
    if loss is None:
        why = f": {_REFUSED[name]}" if name in _REFUSED else ""
        raise UserError(
            f"loss_fn {name!r} is not supported by this server{why} (supported: {', '.join(supported_losses())})"
        )
    return loss
