"""GRPO-shaped forward_backward through the SDK: 8 samples of one prompt, the cookbook's
importance_sampling loss (advantage 0 on the prompt). The engine runs the prompt once for the group
(engine/prefixes.py); each sample's logprobs and the group's loss are what each sample gets alone,
within fp32 rounding, and the run trains on from it."""

from __future__ import annotations

import numpy as np
import pytest
import tinker
from tinker import types

from tests import grpo
from tests.conformance.conftest import TINY
from tests.serverproc import API_KEY
from tinkerd.engine import prefixes
from tinkerd.types import Datum

PROMPT, SAMPLES = 48, 8


def _group(seed: int) -> list[types.Datum]:
    rng = np.random.default_rng(seed)
    return [types.Datum(model_input=types.ModelInput.from_ints(t.tolist()),
                        loss_fn_inputs={k: v.tolist() for k, v in inputs.items()})
            for t, inputs in grpo.samples(rng, rng.integers(1, 150_000, PROMPT), SAMPLES, (4, 13))]


def test_a_grpo_group_equals_each_sample_alone_and_trains(server):
    data = _group(31)
    # What the engine plans for these datums: one group sharing the prompt.
    plan = prefixes.plan([Datum(tokens=np.array(d.model_input.to_ints()), loss_fn_inputs={}) for d in data])
    assert plan is not None and [g.prefix for g in plan] == [PROMPT]
    tc = tinker.ServiceClient(base_url=server.url, api_key=API_KEY).create_lora_training_client(
        base_model=TINY, rank=8, seed=22).result()
    alone = [tc.forward([d], "importance_sampling").result() for d in data]  # one datum: nothing shared
    group = tc.forward_backward(data, "importance_sampling").result()
    for got, want in zip(group.loss_fn_outputs, alone):
        np.testing.assert_allclose(got["logprobs"].data, want.loss_fn_outputs[0]["logprobs"].data, rtol=1e-5, atol=1e-5)
    assert group.metrics["loss:sum"] == pytest.approx(sum(a.metrics["loss:sum"] for a in alone), rel=1e-5, abs=1e-6)
    tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    after = tc.forward_backward(data, "importance_sampling").result()
    assert after.metrics["loss:sum"] < group.metrics["loss:sum"]
