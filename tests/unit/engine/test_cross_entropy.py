"""cross_entropy against hand-computed numbers, and the loss registry's refusals."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tinkerd.engine.losses import LOSSES, get_loss, supported_losses
from tinkerd.errors import UserError
from tinkerd.types import CreateModelOp, Datum, ForwardBackwardOp, LoraSpec

BASE = "tinkerd/tiny-qwen3"


def test_any_sign_weights_by_hand():
    lp = torch.tensor([-1.0, -2.0, -0.5], requires_grad=True)
    w = torch.tensor([1.0, -0.5, 2.0])
    loss, metrics = get_loss("cross_entropy")(lp, {"target_tokens": torch.zeros(3, dtype=torch.long), "weights": w}, {})
    # −(−1·1 + −2·−0.5 + −0.5·2) = −(−1 + 1 − 1) = 1
    assert loss.item() == 1.0
    assert metrics == {"loss:sum": 1.0}
    loss.backward()
    assert torch.equal(lp.grad, -w)  # d loss / d logprob = −weight


def test_missing_weights_are_ones():
    lp = torch.tensor([-1.0, -2.0, -0.5])
    loss, metrics = get_loss("cross_entropy")(lp, {"target_tokens": torch.zeros(3, dtype=torch.long)}, {})
    assert loss.item() == 3.5
    assert metrics["loss:sum"] == 3.5


def test_soft_targets_sum_over_both_axes():
    lp = torch.tensor([[-1.0, -2.0], [-3.0, -4.0]])  # [N=2, K=2]
    w = torch.tensor([[1.0, 0.0], [0.5, 0.5]])
    loss, _ = get_loss("cross_entropy")(lp, {"target_tokens": torch.zeros(2, 2, dtype=torch.long), "weights": w}, {})
    assert loss.item() == 4.5  # −(−1 + 0 − 1.5 − 2)


def test_unknown_loss_names_the_supported_ones():
    assert "cross_entropy" in supported_losses()
    assert set(supported_losses()) == set(LOSSES) | {"custom"}  # custom: an uploaded loss (custom.py)
    with pytest.raises(UserError, match=r"'reinforce' is not supported.*cross_entropy"):
        get_loss("reinforce")


def test_unknown_config_key_is_refused():
    with pytest.raises(UserError, match="clip_low_threshold"):
        get_loss("cross_entropy").resolve_config({"clip_low_threshold": 0.8})


# --- the same numbers through the engine: logprobs are the model's, loss:sum is −Σ lp·w ---------


@pytest.fixture(scope="module")
def ce_model(engine):
    (result,) = engine.run_ops([CreateModelOp("ce-model", BASE, LoraSpec(rank=4, alpha=8.0, seed=5))])
    assert not isinstance(result, Exception)
    return "ce-model"


def reference_logprobs(rt, tokens: np.ndarray) -> np.ndarray:
    """log_softmax of the full model logits in fp64 (the adapter is fresh, so this is the base)."""
    with torch.no_grad():
        logits = rt.model(input_ids=torch.from_numpy(tokens)[None]).logits[0]  # [N, V]
    return torch.log_softmax(logits.double(), -1).numpy()


@pytest.mark.parametrize(
    "case",
    ["hard_weights", "hard_no_weights", "soft_weights"],
)
def test_engine_logprobs_and_loss_by_hand(engine, tiny_runtime, ce_model, case):
    rng = np.random.default_rng(7)
    tokens = [rng.integers(0, 150_000, n) for n in (6, 3)]
    if case == "soft_weights":
        targets = [rng.integers(0, 150_000, (len(t), 3)) for t in tokens]  # [N, K=3]
    else:
        targets = [rng.integers(0, 150_000, len(t)) for t in tokens]
    weights = [rng.normal(size=t.shape).astype(np.float32) for t in targets]
    data = []
    for t, tt, w in zip(tokens, targets, weights):
        inputs = {"target_tokens": tt} if case == "hard_no_weights" else {"target_tokens": tt, "weights": w}
        data.append(Datum(tokens=t, loss_fn_inputs=inputs))

    (result,) = engine.run_ops([ForwardBackwardOp(ce_model, data, "cross_entropy", forward_only=True)])
    assert not isinstance(result, Exception), result

    expected_loss = 0.0
    for i, (t, tt, w) in enumerate(zip(tokens, targets, weights)):
        full = reference_logprobs(tiny_runtime, t)  # [N, V]
        expected_lp = np.take_along_axis(full, tt if tt.ndim == 2 else tt[:, None], axis=1)
        expected_lp = expected_lp if tt.ndim == 2 else expected_lp[:, 0]
        got = result.loss_fn_outputs[i]["logprobs"]
        assert got.dtype == np.float32 and got.shape == tt.shape
        np.testing.assert_allclose(got, expected_lp, rtol=1e-5, atol=1e-5)
        w_used = np.ones(tt.shape) if case == "hard_no_weights" else w.astype(np.float64)
        expected_loss -= float((expected_lp * w_used).sum())
    assert set(result.metrics) == {"loss:sum"}
    assert result.metrics["loss:sum"] == pytest.approx(expected_loss, rel=1e-5, abs=1e-4)
