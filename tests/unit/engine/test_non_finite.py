"""The engine's non-finite guard (engine/finite.py): a step that would make an adapter NaN or inf
fails as a user error, leaves weights, grads and AdamW state bit-identical, and the next good step
equals that of a twin adapter that never saw the bad one."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from tests.unit.engine.test_training import (
    ADAM,
    adapter_of,
    assert_identical,
    create,
    run,
    sft_data,
    snapshot,
    train_step,
)
from tinkerd.errors import UserError
from tinkerd.types import AdamParams, Datum, ForwardBackwardOp, OptimStepOp


def _scaled(datum: Datum, weight: float) -> Datum:
    """The datum with every loss weight set to `weight`: finite in fp32, but times a log-prob of
    about -12 (a 151k vocabulary) the loss overflows fp32's 3.4e38 when weight is 3e38."""
    inputs = dict(datum.loss_fn_inputs)
    inputs["weights"] = np.full_like(inputs["weights"], weight)
    return Datum(datum.tokens, inputs)


def _twins(engine, name: str, seed: int, steps: int) -> tuple[str, str]:
    """Two adapters with equal state: `steps` train steps each, then one pending forward_backward."""
    guarded, twin = f"{name}-guarded", f"{name}-twin"
    for model_id in (guarded, twin):
        create(engine, model_id, seed=seed)
        for s in range(steps):
            train_step(engine, model_id, sft_data(seed + s))
        run(engine, ForwardBackwardOp(model_id, sft_data(seed + 100), "cross_entropy"))
    assert_identical(snapshot(adapter_of(engine, guarded)), snapshot(adapter_of(engine, twin)))
    return guarded, twin


def _refused(engine, op, message: str) -> UserError:
    adapter = adapter_of(engine, op.model_id)
    before = snapshot(adapter)
    (result,) = engine.run_ops([op])
    assert isinstance(result, UserError) and result.category == "user" and result.status_code == 400, result
    assert re.search(message, result.message), result.message
    assert "was not applied" in result.message, result.message
    assert_identical(snapshot(adapter), before)
    return result


def _next_steps_equal(engine, guarded: str, twin: str, seed: int) -> None:
    """The guarded adapter goes on exactly as its twin: two more good steps, bit for bit."""
    for s in range(2):
        loss_g = train_step(engine, guarded, sft_data(seed + 200 + s))
        loss_t = train_step(engine, twin, sft_data(seed + 200 + s))
        assert loss_g == loss_t and np.isfinite(loss_g)
        assert_identical(snapshot(adapter_of(engine, guarded)), snapshot(adapter_of(engine, twin)))


# case -> (a batch of [good, bad] datums, the message naming the culprit)
POISONED_BATCHES = {
    # The loss itself overflows.
    "loss inf": (lambda seed: [sft_data(seed)[0], _scaled(sft_data(seed)[1], 3e38)], r"loss is inf for datum 1"),
    # The loss (measured: 2.6e38) still fits fp32, its gradient through the decoder does not.
    "gradient nan": (lambda seed: [sft_data(seed)[0], _scaled(sft_data(seed)[1], 1e36)],
                     r"gradient of \S+\.lora_[AB] is (nan|-?inf) \(loss \S+\)"),
}


@pytest.mark.parametrize("case", sorted(POISONED_BATCHES))
def test_poisoned_forward_backward_changes_nothing(engine, case):
    batch, message = POISONED_BATCHES[case]
    name = "poison-" + case.replace(" ", "-")
    guarded, twin = _twins(engine, name, seed=40, steps=1)
    refused = _refused(engine, ForwardBackwardOp(guarded, batch(40), "cross_entropy"), message)
    assert "--allow-non-finite" in refused.message  # says how to get the raw behaviour
    _next_steps_equal(engine, guarded, twin, seed=40)


# case -> (AdamParams that overflow, steps taken before: 0 means AdamW has no state yet)
BAD_UPDATES = {
    # lr is cast to the fp32 weights' type inside AdamW: 1e39 is inf there.
    "learning_rate 1e39, first step": (AdamParams(learning_rate=1e39), 0),
    "learning_rate 1e39, later step": (AdamParams(learning_rate=1e39), 2),
    # v = 0 wherever a gradient is 0 (every LoRA A at the first step, while B is 0): 0 / (0 + 0).
    "eps 0, first step": (AdamParams(learning_rate=1e-3, eps=0.0), 0),
    # Each weight times 1 - lr * wd = -1e296, inf in fp32.
    "weight_decay 1e300": (AdamParams(learning_rate=1e-4, weight_decay=1e300), 1),
}


@pytest.mark.parametrize("case", sorted(BAD_UPDATES))
def test_overflowing_optim_step_changes_nothing(engine, case):
    adam, steps = BAD_UPDATES[case]
    name = "update-" + re.sub(r"\W+", "-", case)
    guarded, twin = _twins(engine, name, seed=50, steps=steps)
    _refused(engine, OptimStepOp(guarded, adam), r"the update (would make \S+ (nan|-?inf)|overflows fp32)")
    # The pending gradient survived the refused step: both now apply it with good params.
    run(engine, OptimStepOp(guarded, ADAM))
    run(engine, OptimStepOp(twin, ADAM))
    assert_identical(snapshot(adapter_of(engine, guarded)), snapshot(adapter_of(engine, twin)))
    _next_steps_equal(engine, guarded, twin, seed=50)


def test_allow_non_finite_applies_the_step_as_it_comes(engine):
    create(engine, "raw", seed=60)
    adapter = adapter_of(engine, "raw")
    bad = [sft_data(60)[0], _scaled(sft_data(60)[1], 3e38)]
    result = run(engine, ForwardBackwardOp("raw", bad, "cross_entropy", allow_non_finite=True))
    assert result.metrics["loss:sum"] == float("inf") and adapter.pending_grads == 1
    run(engine, OptimStepOp("raw", AdamParams(learning_rate=1e30), allow_non_finite=True))
    assert adapter.step == 1
    assert any(not bool(torch.isfinite(t).all()) for t in adapter.parameters())


def test_forward_only_reports_a_non_finite_loss(engine):
    """A forward changes nothing, so its loss is returned as computed rather than refused."""
    create(engine, "fwd-inf", seed=61)
    bad = [_scaled(sft_data(61)[0], 3e38)]
    result = run(engine, ForwardBackwardOp("fwd-inf", bad, "cross_entropy", forward_only=True))
    assert result.metrics["loss:sum"] == float("inf")


@pytest.mark.parametrize("foreach", [False, True], ids=["sums", "foreach_norm"])
def test_the_per_tensor_sums_clear_finite_tensors_and_find_every_bad_one(foreach):
    """first_non_finite's fast path (one sum per tensor; on CUDA one L1 foreach norm): tensors whose
    sum overflows fp32 but whose elements are finite are not reported, and a NaN, +inf or -inf
    anywhere is, by name and kind."""
    from tinkerd.engine.finite import first_non_finite

    big = torch.full((4, 3), 3e38)  # each element finite, the sum inf
    ok = [("big", big), ("neg", -big), ("int", torch.tensor([2**62])), ("none", None)]
    assert first_non_finite(ok, foreach=foreach) is None
    for bad, kind in ((float("nan"), "nan"), (float("inf"), "inf"), (float("-inf"), "-inf")):
        t = torch.zeros(5, 7, dtype=torch.bfloat16)
        t[3, 2] = bad
        assert first_non_finite([("ok", torch.ones(3)), ("big", big), ("bad", t)], foreach=foreach) == ("bad", kind)
