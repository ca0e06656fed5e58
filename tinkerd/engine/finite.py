"""The engine's last line against NaN and inf: a training step that would make an adapter
non-finite fails with a UserError and changes nothing.

Requests are bounded where they enter (api/limits.py), but finite inputs can still overflow fp32:
weights of 3e38 times a log-prob of -12 is a loss of inf, and a learning_rate of 1e39 is inf once
AdamW casts it to the fp32 parameters. Before this guard such a step "succeeded" and every later
forward returned loss=nan, with no way back short of reloading a checkpoint.

- forward_backward computes its gradients into fresh tensors (engine/training.py), so checking the
  loss and those tensors before they are added to `.grad` is enough: a refused batch leaves the
  accumulated gradient as it was.
- optim_step is applied in place by torch.optim.AdamW. A step that bounds on the adapter's weights,
  moments and gradients prove finite (engine/step_bounds.py: every step of an ordinary run) just
  runs. Any other is copied first (the adapter's tensors, their grads, which clipping scales in
  place, the AdamW state and the group hyperparameters: 4x the adapter's parameters for the step's
  duration, about 180 MB for a rank-32 SmolLM2 adapter), checked after, and put back when the
  result is not finite.

`allow_non_finite` on the op (`tinkerd serve --allow-non-finite`, and replay of ops logged before
the guard existed) skips all of it.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Callable, Iterable

import torch

from tinkerd.engine.step_bounds import LIMIT, StepBounds, finiteness_sums, magnitude
from tinkerd.errors import UserError
from tinkerd.types import AdamParams

if TYPE_CHECKING:
    from tinkerd.engine.lora.pool import Adapter

OPT_OUT = "(tinkerd serve --allow-non-finite applies such steps anyway)"
# adapter.extra key of the StepBounds its last step left (absent: measure before the next one).
BOUNDS = "step_bounds"
# adapter.extra key of a bound on max |.grad|, present while every forward_backward since the last
# optim_step (or load) was checked: each checked call measures its own gradients' max |g| anyway, so
# optim_step need not pass over the accumulated ones again (note_grad_bound, check_grads_before_step).
GRAD_BOUND = "grad_bound"
# fp32 rounds a + b to within half an ulp: |fl(a + b)| <= (|a| + |b|) * (1 + 2^-24).
SUM_SLACK = 1 + 2.0 ** -22


def kind(t: torch.Tensor) -> str:
    """'nan' if any element is NaN, else 'inf' or '-inf' (for a tensor known to be non-finite)."""
    if torch.isnan(t).any():
        return "nan"
    return "inf" if bool((t == float("inf")).any()) else "-inf"


def tensor_names(adapter: "Adapter") -> dict[int, str]:
    """id(tensor) -> its name in the adapter's files: `<layer>.lora_A` / `.lora_B`."""
    return {id(t): f"{name}.lora_{ab}" for name, pair in adapter.weights.items() for ab, t in zip("AB", pair)}


def first_non_finite(named: Iterable[tuple[str, torch.Tensor | None]],
                     foreach: bool | None = None) -> tuple[str, str] | None:
    """The first (name, 'nan' / 'inf' / '-inf') of `named` with a non-finite element, else None.
    `foreach`: one multi-tensor reduction for all (default: on CUDA), else one sum per tensor."""
    named = [(name, t) for name, t in named if t is not None and t.is_floating_point()]
    if not named:
        return None
    # A sum is NaN or +-inf whenever an element is, so finite sums clear every tensor at once: one
    # reduction per tensor instead of isfinite's four elementwise passes (a SmolLM2 rank-32 step
    # checks ~2,100 tensors: ~150 ms that way, ~25 ms this way). A sum of finite values can still
    # overflow, so a non-finite sum only sends the check element by element.
    sums = finiteness_sums([t.detach() for _, t in named], foreach)
    if bool(torch.isfinite(sums).all()):
        return None
    for name, t in named:
        if not bool(torch.isfinite(t).all()):
            return name, kind(t)
    return None


def check_forward_backward(adapter: "Adapter", loss_sum: torch.Tensor, n: int,
                           per_datum_loss: Callable[[int], torch.Tensor], params, grads,
                           largest: float | None = None) -> float:
    """Refuse a batch of `n` datums whose loss or fresh gradients are not finite, before they reach
    `.grad`; else max |g| over the fresh gradients (one aminmax per tensor: ~1 ms more than the sums
    first_non_finite takes, on SmolLM2's rank-32 adapter). `per_datum_loss(i)` recomputes datum i's loss alone (only on this
    failure path), to name it. `largest`: that max, measured already (step_bounds.magnitudes, for the
    runs of a shared pass at once)."""
    if not bool(torch.isfinite(loss_sum)):
        culprit = next((i for i in range(n) if not _finite_or_unknown(per_datum_loss, i)), None)
        where = f"for datum {culprit}" if culprit is not None else f"over the batch of {n} datums"
        raise UserError(f"loss is {kind(loss_sum)} {where}; the forward_backward was not applied and the "
                        f"accumulated gradients are unchanged {OPT_OUT}")
    if largest is None:
        largest = magnitude(grads)
    if math.isfinite(largest):
        return largest
    names = tensor_names(adapter)
    bad = first_non_finite((names[id(p)], g) for p, g in zip(params, grads))
    raise UserError(f"gradient of {bad[0]} is {bad[1]} (loss {float(loss_sum):g}); the forward_backward was "
                    f"not applied and the accumulated gradients are unchanged {OPT_OUT}")


def note_grad_bound(adapter: "Adapter", before: int, largest: float | None) -> None:
    """After a forward_backward added gradients of max |g| <= `largest` to `.grad` (None: unchecked,
    --allow-non-finite), where `before` calls had added theirs since the last optim_step: keep a bound
    on max |.grad| while every such call was checked, else none (optim_step then measures)."""
    held = adapter.extra.pop(GRAD_BOUND, None)
    if largest is None:
        return
    if before == 0:  # .grad was empty (None) before this call
        adapter.extra[GRAD_BOUND] = largest
    elif held is not None:  # every earlier call since then was checked (an unchecked one dropped it)
        adapter.extra[GRAD_BOUND] = (held + largest) * SUM_SLACK


def _finite_or_unknown(per_datum_loss, i: int) -> bool:
    try:
        return bool(torch.isfinite(per_datum_loss(i)))
    except UserError:  # a loss that cannot run on one datum alone: no verdict
        return True


class StepUndo:
    """What an optim_step changes in place, copied before it: restore() puts it all back bit for bit."""

    def __init__(self, adapter: "Adapter"):
        self.optimizer = adapter.optimizer
        params = adapter.parameters()
        self.tensors = [(p, p.detach().clone(), None if p.grad is None else p.grad.clone()) for p in params]
        state = self.optimizer.state
        self.state = {p: {k: v.clone() if torch.is_tensor(v) else v for k, v in state[p].items()}
                      for p in params if p in state}
        self.groups = [{k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups]

    def restore(self) -> None:
        with torch.no_grad():
            for p, data, grad in self.tensors:
                p.copy_(data)
                p.grad = grad
        for p, _, _ in self.tensors:
            if p in self.state:
                self.optimizer.state[p] = self.state[p]
            else:
                self.optimizer.state.pop(p, None)  # the first step created it
        for group, saved in zip(self.optimizer.param_groups, self.groups):
            group.update(saved)


def check_grads_before_step(adapter: "Adapter") -> float:
    """A bound on max |grad| over the accumulated grads: the one every checked forward_backward since
    the last step kept (note_grad_bound) while it is below step_bounds.LIMIT, else measured. They are
    finite whenever every forward_backward was checked; not so if some ran with the guard off, or if
    finite batches summed past fp32's 3.4e38 (a kept bound that large is measured instead)."""
    held = adapter.extra.get(GRAD_BOUND)
    if held is not None and held < LIMIT:
        return held
    grads = magnitude(p.grad for p in adapter.parameters())
    if not math.isfinite(grads):
        names = tensor_names(adapter)
        bad = first_non_finite((names[id(p)], p.grad) for p in adapter.parameters())
        raise UserError(f"accumulated gradient of {bad[0]} is {bad[1]}; the optim_step was not applied {OPT_OUT}")
    return grads


def proven_step(adapter: "Adapter", held: StepBounds | None, grads: float, p: AdamParams) -> StepBounds | None:
    """The adapter's bounds after a step with gradients |g| <= `grads`, when they prove it finite
    (engine/step_bounds.py), else None: the step must be copied and checked. `held`: the bounds the
    last step left, measured afresh when they are missing or belong to another optimizer."""
    if held is None or not held.holds_for(adapter.optimizer):
        if not p.eps > 0:  # no bound can prove such a step; spare the measuring pass
            return None
        held = StepBounds.measured(adapter.optimizer, adapter.parameters())
    return None if held is None else held.after_step(grads, p)


def check_step_result(adapter: "Adapter") -> tuple[StepBounds | None, tuple[str, str] | None]:
    """(the exact bounds of the step's result, for the next step; None when it is not finite, and then
    the first weight or AdamW state tensor it left non-finite, as (name, kind))."""
    bounds = StepBounds.measured(adapter.optimizer, adapter.parameters())
    if bounds is not None:
        return bounds, None
    names = tensor_names(adapter)
    state = adapter.optimizer.state
    found = first_non_finite((names[id(p)], p) for p in adapter.parameters())
    if found is None:
        found = first_non_finite((f"AdamW {k} of {names[id(p)]}", v) for p in adapter.parameters()
                                 for k, v in state.get(p, {}).items() if torch.is_tensor(v))
    return None, found
