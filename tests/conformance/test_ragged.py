"""A forward_backward of datums of very different lengths, through the SDK: the engine runs it in
length buckets instead of one batch padded to the longest datum (engine/buckets.py), and each datum's
logprobs and the batch's loss are what each datum gets alone, within fp32 rounding; then the run
trains on from it."""

from __future__ import annotations

import numpy as np
import pytest
import tinker
from tinker import types

from tests.conformance.conftest import TINY
from tests.serverproc import API_KEY
from tinkerd.engine import buckets

# 2400 padded positions for 901 real ones: bucketed.
LENGTHS = (400, 12, 30, 380, 9, 70)


def _datum(rng, n: int) -> types.Datum:
    tokens = rng.integers(1, 150_000, n + 1).tolist()
    weights = rng.random(n).astype(np.float32).tolist()
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                       loss_fn_inputs={"target_tokens": tokens[1:], "weights": weights})


def test_a_ragged_batch_equals_each_datum_alone_and_trains(server):
    assert buckets.plan(list(LENGTHS)) is not None
    tc = tinker.ServiceClient(base_url=server.url, api_key=API_KEY).create_lora_training_client(
        base_model=TINY, rank=8, seed=21).result()
    data = [_datum(np.random.default_rng(k), n) for k, n in enumerate(LENGTHS)]
    alone = [tc.forward([d], "cross_entropy").result() for d in data]  # one datum: no padding at all
    batch = tc.forward_backward(data, "cross_entropy").result()
    for got, want in zip(batch.loss_fn_outputs, alone):
        np.testing.assert_allclose(got["logprobs"].data, want.loss_fn_outputs[0]["logprobs"].data, rtol=1e-5, atol=1e-5)
    assert batch.metrics["loss:sum"] == pytest.approx(sum(a.metrics["loss:sum"] for a in alone), rel=1e-5)
    tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    after = tc.forward_backward(data, "cross_entropy").result()
    assert after.metrics["loss:sum"] < batch.metrics["loss:sum"]
