"""Datums of very different lengths run in length buckets (engine/buckets.py), with the padded
batch's numbers: loss, per-token logprobs and LoRA gradients within fp32 rounding of one padded batch
of the same datums; tests/parity/test_lora_parity.py pins a bucketed batch against HF + PEFT."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tinkerd.engine import buckets, cotrain
from tinkerd.types import ForwardBackwardOp

from tests.parity.test_lora_parity import assert_close_scaled
from tests.unit.engine.test_training import BASE, adapter_of, create, run, sft_data

# A ragged batch: 1688 of its 2880 padded positions would be padding.
LENGTHS = (360, 24, 80, 350, 18, 120, 50, 190)
MIN_PADDING = buckets.MIN_PADDING


def test_the_plan_buckets_only_a_batch_that_is_mostly_padding():
    assert buckets.plan([256, 256]) is None  # no padding
    assert buckets.plan([9, 13, 6, 11]) is None  # padding, but a few positions: one batch
    assert buckets.plan([400] * 8 + [300] * 8) is None  # 800 padding positions, under MIN_PADDING
    plan = buckets.plan(list(LENGTHS))
    assert sorted(i for group in plan for i in group) == list(range(len(LENGTHS)))
    for group in plan:  # each bucket longest first, its padding within SLACK
        widths = [LENGTHS[i] for i in group]
        assert widths == sorted(widths, reverse=True)
        assert widths[0] * len(widths) - sum(widths) <= buckets.SLACK * widths[0] * len(widths)
    padded = sum(LENGTHS[g[0]] * len(g) for g in plan)
    assert padded < 0.6 * max(LENGTHS) * len(LENGTHS)


def _pass(engine, model_id, data, bucketed: bool, monkeypatch):
    monkeypatch.setattr(buckets, "MIN_PADDING", MIN_PADDING if bucketed else 10**9)
    calls = []
    hook = engine.runtime(BASE).model.get_decoder().register_forward_hook(lambda *_: calls.append(1))
    try:
        result = run(engine, ForwardBackwardOp(model_id, data, "cross_entropy"))
    finally:
        hook.remove()
    adapter = adapter_of(engine, model_id)
    grads = [t.grad.clone() for t in adapter.parameters()]
    for t in adapter.parameters():
        t.grad = None
    adapter.pending_grads = 0
    return len(calls), result, grads


def test_a_ragged_batch_runs_in_buckets_with_the_padded_batchs_numbers(engine, monkeypatch):
    data = sft_data(5, lengths=LENGTHS)
    planned = len(buckets.plan(list(LENGTHS)))
    assert planned > 1
    create(engine, "buckets-a", seed=4)
    n_bucketed, got, got_grads = _pass(engine, "buckets-a", data, True, monkeypatch)
    n_padded, want, want_grads = _pass(engine, "buckets-a", data, False, monkeypatch)
    assert (n_bucketed, n_padded) == (planned, 1)
    assert got.metrics["loss:sum"] == pytest.approx(want.metrics["loss:sum"], rel=1e-5)
    for a, b in zip(got.loss_fn_outputs, want.loss_fn_outputs):
        np.testing.assert_allclose(a["logprobs"], b["logprobs"], rtol=1e-5, atol=1e-5)
    for a, b in zip(got_grads, want_grads):
        assert_close_scaled(a, b, "a LoRA gradient")
    # The same op again runs the same buckets: a replay after a crash gives the same bits.
    n_again, again, again_grads = _pass(engine, "buckets-a", data, True, monkeypatch)
    assert n_again == planned
    assert again.metrics == got.metrics
    assert all(torch.equal(a, b) for a, b in zip(again_grads, got_grads))
    # A bucketed op does not share a pass with other runs (their rows would be padded together).
    assert cotrain.pass_key(engine, ForwardBackwardOp("buckets-a", data, "cross_entropy")) is None
    assert cotrain.pass_key(engine, ForwardBackwardOp("buckets-a", data[:2], "cross_entropy")) is not None
