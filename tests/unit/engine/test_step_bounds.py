"""engine/step_bounds.py: an optim_step runs without its undo copy and its check only when bounds
prove it finite, and every step so proven is finite and inside the bounds it carries forward."""

from __future__ import annotations

import math
import weakref

import numpy as np
import pytest
import torch

from tests.unit.engine.test_training import ADAM, adapter_of, create, run, sft_data, train_step
from tinkerd.engine import finite
from tinkerd.engine.step_bounds import LIMIT, StepBounds, magnitude, magnitudes
from tinkerd.types import AdamParams, ForwardBackwardOp, OptimStepOp


def _draw(rng: np.random.Generator) -> tuple[AdamParams, float, float]:
    """Hyperparameters, a weight scale and a gradient scale, log-uniform over ranges that reach both
    sides of LIMIT and fp32's 3.4e38."""
    def pick(lo, hi):
        return float(10 ** rng.uniform(lo, hi))

    adam = AdamParams(
        learning_rate=pick(-6, 30),
        beta1=float(rng.choice([0.0, 0.5, 0.9, 0.999999])),
        beta2=float(rng.choice([0.0, 0.95, 0.999999])),
        eps=float(rng.choice([0.0, pick(-30, 2), pick(-12, -6)])),
        weight_decay=float(rng.choice([0.0, pick(-4, 2), pick(-4, 40)])),
    )
    return adam, pick(-3, 33), pick(-3, 20)


@pytest.mark.parametrize("foreach", [False, True], ids=["aminmax", "foreach_norm"])
def test_magnitude_is_the_exact_max_abs_and_propagates_nan_and_inf(foreach):
    """Both ways (per-tensor aminmax; on CUDA, foreach norms): max |x| exactly, over tensors whose
    L1 sum overflows too, and nan / inf whenever an element is, in any tensor and dtype."""
    gen = torch.Generator().manual_seed(3)
    ts = [torch.randn(7, 5, generator=gen) * 10 ** k for k in range(-3, 4)]
    ts += [torch.randn(4, 4, generator=gen).bfloat16(), torch.empty(0), None, torch.full((9,), -3e38)]
    want = max(float(t.detach().abs().max()) for t in ts if t is not None and t.numel())
    assert magnitude(ts, foreach=foreach) == want  # the -3e38 tensor's: its L1 sum is inf
    assert magnitude(ts[:3], foreach=foreach) == max(float(t.abs().max()) for t in ts[:3])
    assert magnitude([None, torch.empty(0)], foreach=foreach) == 0.0
    for bad in (float("nan"), float("inf"), float("-inf")):
        for where in (0, 7):
            poisoned = [t.clone() if t is not None else None for t in ts]
            poisoned[where].view(-1)[3] = bad
            got = magnitude(poisoned, foreach=foreach)
            assert math.isnan(got) if math.isnan(bad) else got == float("inf"), (bad, where)


def test_magnitude_of_fp32_gradients_takes_one_dispatch_per_tensor():
    """Fresh fp32 gradients (no requires_grad) get one aminmax each and no detach or cast: each of
    those is a dispatch, 422 tensors a SmolLM2 adapter; a weight that requires grad is detached."""
    from benchmarks.launches import OpCount

    gen = torch.Generator().manual_seed(4)
    grads = [torch.randn(5, 3, generator=gen) * 10.0 ** (k - 20) for k in range(40)]
    with OpCount(views=True) as count:
        got = magnitude(grads)
    assert got == max(float(t.abs().max()) for t in grads)
    assert count.ops["aminmax"] == len(grads) and count.total <= len(grads) + 8, count.ops
    weight = torch.randn(4, generator=gen, requires_grad=True)
    assert magnitude([weight]) == float(weight.detach().abs().max())


def test_magnitudes_of_runs_sharing_stacked_gradients_equal_each_runs_magnitude():
    """A shared pass's batched GEMMs give each run its gradients as slices of [k, ...] tensors
    (engine/lora/fused.py): magnitudes() reduces those per stacked tensor and gives each run exactly
    magnitude() of its own tensors, runs at any slice (not their order), with a partial view, a
    transposed slice and plain tensors beside them; a NaN or an inf in one run's slice reaches that
    run only."""
    gen = torch.Generator().manual_seed(5)
    stacks = [torch.randn(3, 4, 6, generator=gen) * 10 ** k for k in (-2, 0, 3)]
    odd = torch.randn(3, 5, 4, generator=gen)  # run r's view of it: a transposed slice, not base[r]
    at = {0: 2, 1: 0, 2: 1}  # run -> its slice of every stack
    runs = [[*(s.unbind(0)[at[r]] for s in stacks), odd[r].t(), stacks[0][at[r], :2],
             torch.randn(7, generator=gen) * 10 ** r, None, torch.empty(0)] for r in range(3)]
    assert magnitudes(runs) == [magnitude(ts) for ts in runs]
    assert magnitudes([runs[1], [None]]) == [magnitude(runs[1]), 0.0]
    for bad in (float("nan"), float("inf"), float("-inf")):
        poisoned = [t.clone() for t in stacks]
        poisoned[1][at[2], 3, 1] = bad
        mixed = [[*(s.unbind(0)[at[r]] for s in poisoned), *ts[len(stacks):]] for r, ts in enumerate(runs)]
        got = magnitudes(mixed)
        assert got[:2] == [magnitude(ts) for ts in mixed[:2]] and all(math.isfinite(g) for g in got[:2])
        assert math.isnan(got[2]) if math.isnan(bad) else got[2] == float("inf"), bad


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "foreach"])
def test_every_proven_step_is_finite_and_inside_its_bounds(fused):
    rng = np.random.default_rng(0)
    proven = overflowed = 0
    for trial in range(400):
        adam, weight_scale, grad_scale = _draw(rng)
        params = [(torch.rand(n) * 2 - 1) * weight_scale for n in (7, 33)]
        for p in params:
            p.requires_grad_(True)
        opt = torch.optim.AdamW(params, **({"fused": True} if fused else {"foreach": True}))
        held = StepBounds.measured(opt, params)
        for step in range(3):  # bounds carried over steps, as the engine does
            for p in params:
                p.grad = (torch.rand(p.shape) * 2 - 1) * grad_scale
                p.grad[0] = 0.0  # v = 0 there: a zero denominator but for eps
            grads = magnitude(p.grad for p in params)
            nxt = held.after_step(grads, adam) if held is not None else None
            for group in opt.param_groups:
                group.update(lr=adam.learning_rate, betas=(adam.beta1, adam.beta2), eps=adam.eps,
                             weight_decay=adam.weight_decay)
            try:
                opt.step()
            except RuntimeError:  # a scalar that does not fit fp32
                assert nxt is None, (trial, step, adam)
                overflowed += 1
                break
            state = [opt.state[p] for p in params]
            finite_now = all(bool(torch.isfinite(t).all()) for t in params + [s["exp_avg"] for s in state]
                             + [s["exp_avg_sq"] for s in state])
            if nxt is None:
                overflowed += not finite_now
                break
            proven += 1
            assert finite_now, (trial, step, adam, weight_scale, grad_scale)
            assert magnitude(params) <= nxt.weights, (trial, step, adam)
            assert magnitude(s["exp_avg"] for s in state) <= nxt.exp_avg
            assert magnitude(s["exp_avg_sq"] for s in state) <= nxt.exp_avg_sq
            held = nxt
    # Neither side is empty: many steps are proven, and the unproven include real overflows.
    assert proven > 150 and overflowed > 20, (proven, overflowed)


def test_bounds_hold_only_for_the_optimizer_they_were_measured_on(engine):
    """A bound left by another optimizer (load_weights gives the adapter a new one) is measured anew:
    weights of 1e37 that a weight decay of |1 - lr * wd| = 100 takes past fp32 are not 'proven'."""
    create(engine, "bounds-load", seed=3)
    train_step(engine, "bounds-load", sft_data(3))
    adapter = adapter_of(engine, "bounds-load")
    stale = StepBounds(weakref.ref(torch.optim.SGD([torch.zeros(1, requires_grad=True)])), 1.0, 1.0, 1.0)
    with torch.no_grad():
        adapter.parameters()[0].fill_(1e37)
    growing = AdamParams(learning_rate=1e-2, weight_decay=10100.0)
    assert stale.after_step(1.0, growing) is not None  # the stale bound alone would let it through
    assert finite.proven_step(adapter, stale, 1.0, growing) is None


def test_an_ordinary_run_steps_without_the_copy_and_a_refused_step_measures_anew(engine, monkeypatch):
    copies = []
    real = finite.StepUndo
    monkeypatch.setattr(finite, "StepUndo", lambda adapter: copies.append(1) or real(adapter))
    create(engine, "bounds-run", seed=4)
    for s in range(3):
        assert math.isfinite(train_step(engine, "bounds-run", sft_data(4 + s)))
    assert copies == []  # the first step's bounds are measured before it, the others carried
    held = adapter_of(engine, "bounds-run").extra[finite.BOUNDS]
    assert 0 < held.weights < LIMIT and held.exp_avg > 0 and held.exp_avg_sq > 0

    # A step the bounds cannot prove (lr 1e39) is copied, refused, and leaves no bound behind ...
    run(engine, ForwardBackwardOp("bounds-run", sft_data(9), "cross_entropy"))
    (refused,) = engine.run_ops([OptimStepOp("bounds-run", AdamParams(learning_rate=1e39))])
    assert refused.category == "user" and copies == [1]
    assert finite.BOUNDS not in adapter_of(engine, "bounds-run").extra
    # ... and the next good step measures the adapter again and runs without a copy.
    run(engine, OptimStepOp("bounds-run", ADAM))
    assert copies == [1] and finite.BOUNDS in adapter_of(engine, "bounds-run").extra


def test_a_finite_step_past_the_bounds_is_checked_and_applied(engine, monkeypatch):
    """lr 1e25 is beyond what the bounds can prove, but its update (~1e26) fits fp32: the step is
    copied, checked and applied, and the check leaves exact bounds for the next step."""
    copies = []
    real = finite.StepUndo
    monkeypatch.setattr(finite, "StepUndo", lambda adapter: copies.append(1) or real(adapter))
    create(engine, "bounds-big", seed=5)
    train_step(engine, "bounds-big", sft_data(5), AdamParams(learning_rate=1e25))
    adapter = adapter_of(engine, "bounds-big")
    assert copies == [1] and adapter.step == 1
    assert magnitude(adapter.parameters()) > 1e20
    assert adapter.extra[finite.BOUNDS].weights == magnitude(adapter.parameters())


def test_optim_step_takes_the_gradient_bound_its_forward_backwards_kept(engine, monkeypatch):
    """Each checked forward_backward measures its gradients' max |g|; optim_step takes their sum as
    its bound on max |.grad| instead of passing over the accumulated gradients again. The bound
    holds (and is exact after one call), and a call with the guard off drops it."""
    measured = []
    real = finite.magnitude
    monkeypatch.setattr(finite, "magnitude", lambda ts: measured.append(1) or real(ts))
    create(engine, "grad-bound", seed=6)
    adapter = adapter_of(engine, "grad-bound")
    run(engine, ForwardBackwardOp("grad-bound", sft_data(6), "cross_entropy"))
    grads = lambda: magnitude(p.grad for p in adapter.parameters())  # noqa: E731
    assert adapter.extra[finite.GRAD_BOUND] == grads()
    for k in (2, 3):
        run(engine, ForwardBackwardOp("grad-bound", sft_data(6 + k), "cross_entropy"))
        bound = adapter.extra[finite.GRAD_BOUND]
        assert adapter.pending_grads == k and grads() <= bound < 3 * grads()
    measured.clear()
    assert finite.check_grads_before_step(adapter) == bound and measured == []
    run(engine, OptimStepOp("grad-bound", ADAM))
    assert finite.GRAD_BOUND not in adapter.extra and adapter.pending_grads == 0

    # A forward_backward with the guard off leaves no bound: the next optim_step measures.
    run(engine, ForwardBackwardOp("grad-bound", sft_data(10), "cross_entropy"))
    run(engine, ForwardBackwardOp("grad-bound", sft_data(11), "cross_entropy", allow_non_finite=True))
    assert finite.GRAD_BOUND not in adapter.extra
    run(engine, ForwardBackwardOp("grad-bound", sft_data(12), "cross_entropy"))
    assert finite.GRAD_BOUND not in adapter.extra  # one of the three calls was not measured
    measured.clear()
    assert finite.check_grads_before_step(adapter) == grads() and measured == [1]
