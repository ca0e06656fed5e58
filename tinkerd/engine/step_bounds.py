"""Bounds on an adapter's weights and AdamW moments that prove an optim_step stays finite.

The non-finite guard (engine/finite.py) copies everything AdamW changes before a step and checks
everything after it: for a rank-32 SmolLM2 adapter (11.4M parameters) ~50 of a ~75 ms optim_step,
for steps that in practice never fail. Those steps can be told apart beforehand. With finite
weights |p| <= P, moments |m| <= M and v <= V, and gradients |g| <= G, AdamW (decoupled weight
decay, torch's fused and foreach kernels alike) computes

    p1 = p * (1 - lr * wd)                     |p1| <= P * |1 - lr * wd|
    m' = b1 * m + (1 - b1) * g                 |m'| <= max(M, G)        (a convex combination)
    v' = b2 * v + (1 - b2) * g * g             v'  <= max(V, G^2)
    p' = p1 - lr / bc1 * m' / (sqrt(v' / bc2) + eps)

with bc1 = 1 - b1^t >= 1 - b1 and bc2 = 1 - b2^t >= 1 - b2 at any step t >= 1, and a denominator
of at least eps, so |p'| <= P * |1 - lr * wd| + lr / (1 - b1) * max(M, G) / eps. When eps > 0 and
that bound and every intermediate (lr, lr * wd, G^2, the step size, m' / eps, ...) stay under
LIMIT, 10^8 below fp32's 3.4e38 so that a few roundings cannot cross the gap, no element can
become NaN or inf, and the step runs without the copy and the check; clipping only scales the
gradients down, so G holds through it.

The bounds come from an exact pass (the checked step's own check, max |x| over every tensor) and
then grow analytically with each unchecked step: the weight bound by at most lr / (1 - b1) *
max(M, G) / eps a step (1e4 * max(M, G) at lr 1e-4, eps 1e-8), so a run takes the checked path
again only after ~1e20 such steps or after a step whose hyperparameters leave no such margin
(lr 1e39, weight decay 1e300, eps 0: the BAD_UPDATES of test_non_finite), which then measures anew.
A bound holds only for the optimizer it was measured on: load_weights gives the adapter a new one.
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass
from typing import Iterable

import torch

from tinkerd.types import AdamParams

LIMIT = 1e30
# A stored bound is raised this much over its real-valued bound: fp32 rounding of the few operations
# of a step moves a result by ~1e-7 of it.
SLACK = 1 + 1e-5


def finiteness_sums(tensors: list[torch.Tensor], foreach: bool | None = None) -> torch.Tensor:
    """One fp32 value per tensor that is NaN or +-inf whenever one of its elements is (and may also
    be inf when a sum of finite values overflows): its sum, or with `foreach` (default: on CUDA) its
    L1 norm from torch._foreach_norm, a few launches for all tensors where the sums take one each
    (423 per SmolLM2 step). On the CPU foreach loops per tensor and ran 3x slower than the sums."""
    if tensors[0].is_cuda if foreach is None else foreach:
        return torch.stack(torch._foreach_norm(tensors, 1, dtype=torch.float32))
    return torch.stack([t.sum(dtype=torch.float32) for t in tensors])


def magnitude(tensors: Iterable[torch.Tensor | None], foreach: bool | None = None) -> float:
    """max |x| over all elements of `tensors`: nan when one is NaN, inf when one is +-inf, 0 for none.
    One aminmax pass per tensor, as fast as the sum the finite check used to take. `foreach` (default:
    on CUDA, where those are 423 launches per SmolLM2 optim_step): two multi-tensor norms instead."""
    # Gradients need no detach and fp32 no cast: each is a dispatch, and a SmolLM2 adapter has 422 tensors.
    tensors = [t.detach() if t.requires_grad else t for t in tensors if t is not None and t.numel()]
    if not tensors:
        return 0.0
    if tensors[0].is_cuda if foreach is None else foreach:
        # The inf norm is max |x|, exact; whether it propagates NaN is the kernel's business, so the
        # L1 norms vouch that every element is finite first, and anything else takes the exact
        # per-tensor path below.
        if bool(torch.isfinite(finiteness_sums(tensors, foreach=True)).all()):
            return float(torch.stack(torch._foreach_norm(tensors, float("inf"), dtype=torch.float32)).max())
    lows, highs = [], []
    for t in tensors:
        low, high = torch.aminmax(t)
        lows.append(low if low.dtype == torch.float32 else low.float())
        highs.append(high if high.dtype == torch.float32 else high.float())
    return float(torch.maximum(-torch.stack(lows).min(), torch.stack(highs).max()))  # both propagate NaN


def magnitudes(runs: list[list[torch.Tensor | None]]) -> list[float]:
    """magnitude() of each run's tensors, all runs at once. A shared training pass's batched LoRA
    GEMMs (engine/lora/fused.py) give k runs their gradients of one layer as the k slices of one
    [k, ...] tensor; those are reduced per stacked tensor (its k minima and maxima in two calls)
    rather than per slice. 4 runs of 1 x 8 tokens on SmolLM2, rank 32: 1,688 aminmax calls a pass,
    each a dispatch and two casts, ~49 ms of a ~540 ms pass; the rest of a run's tensors as before."""
    rest: list[list[torch.Tensor]] = [[] for _ in runs]
    stacks: dict[int, tuple[torch.Tensor, dict[int, int]]] = {}  # id(stacked) -> (it, {run: slice})
    for r, tensors in enumerate(runs):
        for t in tensors:
            if t is None or not t.numel():
                continue
            j = _slice_of(t)
            if j is None:
                rest[r].append(t)
            else:
                stacks.setdefault(id(t._base), (t._base, {}))[1].setdefault(r, j)
    # Stacks holding the same runs at the same slices reduce together: [n, k] minima and maxima.
    layouts: dict[tuple, list[torch.Tensor]] = {}
    for base, where in stacks.values():
        layouts.setdefault((base.shape[0], tuple(sorted(where.items()))), []).append(base.detach())
    lows: list[list[torch.Tensor]] = [[] for _ in runs]
    highs: list[list[torch.Tensor]] = [[] for _ in runs]
    for (k, where), bases in layouts.items():
        flat = [b.view(k, -1) for b in bases]
        low = torch.stack([f.amin(1) for f in flat]).amin(0).float()  # [k]; amin and amax propagate NaN
        high = torch.stack([f.amax(1) for f in flat]).amax(0).float()
        for r, j in where:
            lows[r].append(low[j])
            highs[r].append(high[j])
    out = []
    for r in range(len(runs)):
        alone = magnitude(rest[r])
        if not lows[r]:
            out.append(alone)
            continue
        both = torch.maximum(-torch.stack(lows[r]).min(), torch.stack(highs[r]).max())
        out.append(float(torch.maximum(both, both.new_tensor(alone))))  # NaN wins either way
    return out


def _slice_of(t: torch.Tensor) -> int | None:
    """j when t is exactly base[j] of a contiguous tensor `base` it is a view of, else None."""
    base = t._base
    if base is None or base.dim() != t.dim() + 1 or base.shape[1:] != t.shape or not (
            base.is_contiguous() and t.is_contiguous()):
        return None
    offset = t.storage_offset() - base.storage_offset()
    return offset // t.numel() if offset % t.numel() == 0 else None


@dataclass(frozen=True)
class StepBounds:
    """Upper bounds on max |weight|, max |exp_avg| and max exp_avg_sq of one optimizer's adapter."""

    optimizer: "weakref.ref[torch.optim.Optimizer]"
    weights: float
    exp_avg: float
    exp_avg_sq: float

    @classmethod
    def measured(cls, optimizer: torch.optim.Optimizer, params: list[torch.Tensor]) -> "StepBounds | None":
        """Exact bounds of `optimizer`'s current state; None when some element is not finite."""
        state = optimizer.state
        weights = magnitude(params)
        exp_avg = magnitude(state[p].get("exp_avg") for p in params if p in state)
        exp_avg_sq = magnitude(state[p].get("exp_avg_sq") for p in params if p in state)
        if not all(math.isfinite(x) for x in (weights, exp_avg, exp_avg_sq)):
            return None
        return cls(weakref.ref(optimizer), weights, exp_avg, exp_avg_sq)

    def holds_for(self, optimizer: torch.optim.Optimizer) -> bool:
        return self.optimizer() is optimizer

    def after_step(self, grads: float, p: AdamParams) -> "StepBounds | None":
        """The bounds after one AdamW step with gradients |g| <= `grads` and hyperparameters `p`, or
        None when they cannot show it finite (the step must then be copied and checked)."""
        if not p.eps > 0 or not p.beta1 < 1 or not p.beta2 < 1:
            return None
        step_size = p.learning_rate / (1 - p.beta1)
        exp_avg = max(self.exp_avg, grads)
        exp_avg_sq = max(self.exp_avg_sq, grads * grads)
        decay = p.learning_rate * p.weight_decay
        weights = self.weights * abs(1 - decay) + step_size * exp_avg / p.eps
        steps = (p.learning_rate, decay, step_size, grads * grads, exp_avg / p.eps, step_size * exp_avg,
                 step_size * exp_avg / p.eps, math.sqrt(exp_avg_sq / (1 - p.beta2)), weights)
        if not all(x < LIMIT for x in steps):  # also False for NaN
            return None
        return StepBounds(self.optimizer, weights * SLACK, exp_avg * SLACK, exp_avg_sq * SLACK)
