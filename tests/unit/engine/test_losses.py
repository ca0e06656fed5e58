"""The RL losses against hand-computed values and gradients, the registry's refusals, and the engine
applying exactly d loss / d logprobs for every loss.

Shared small case (5 positions): lp learner log-probs, q sampler log-probs, A advantages, so the
ratios r = exp(lp − q) are 1, e^.5, e^−.5, e^−.5, e^.5 — inside, above and below PPO's [0.8, 1.2]
with both signs of A.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from tests.unit.engine.reference_grads import (
    assert_grads_close,
    create_model,
    split,
    step,
    take_grads,
    weighted_cross_entropy_grads,
)
from tinkerd.engine.losses import DATUM_INDEX, get_loss, supported_losses
from tinkerd.errors import UserError
from tinkerd.types import Datum, ForwardBackwardOp

E5, EM5 = math.exp(0.5), math.exp(-0.5)
LP = [-1.0, -0.5, -2.0, -2.0, -0.5]
Q = [-1.0, -1.0, -1.5, -1.5, -1.0]
A = [1.0, 2.0, -1.0, 1.0, -1.0]


def run_loss(name: str, lp: list[float], extra: dict | None = None, config: dict | None = None):
    """(loss, metrics, d loss / d lp) for one call, inputs as the engine would build them."""
    loss = get_loss(name)
    lp_t = torch.tensor(lp, dtype=torch.float64, requires_grad=True)
    inputs = {"target_tokens": torch.zeros(len(lp), dtype=torch.long), DATUM_INDEX: torch.zeros(len(lp), dtype=torch.long)}
    inputs |= {k: torch.tensor(v, dtype=torch.float64) for k, v in (extra or {}).items()}
    value, metrics = loss(lp_t, inputs, loss.resolve_config(config or {}))
    (grad,) = torch.autograd.grad(value, lp_t)
    return value.item(), metrics, grad.tolist()


RL = {"logprobs": Q, "advantages": A}


def test_importance_sampling_by_hand():
    value, metrics, grad = run_loss("importance_sampling", LP, RL)
    r = [1.0, E5, EM5, EM5, E5]
    assert value == pytest.approx(-(1 * 1 + E5 * 2 - EM5 + EM5 - E5))
    assert metrics == {"loss:sum": pytest.approx(value)}
    assert grad == pytest.approx([-ri * ai for ri, ai in zip(r, A)])  # −r·A


def test_ppo_by_hand():
    value, metrics, grad = run_loss("ppo", LP, RL)
    # Per position min(r·A, clip(r)·A): 1, min(2e^.5, 2.4)=2.4, min(−e^−.5, −0.8)=−0.8,
    # min(e^−.5, 0.8)=e^−.5, min(−e^.5, −1.2)=−e^.5.
    assert value == pytest.approx(-(1 + 2.4 - 0.8 + EM5 - E5))
    # Positions 1 and 2 take the clipped (constant) term: no gradient there.
    assert grad == pytest.approx([-1.0, 0.0, 0.0, -EM5, E5])
    assert metrics == {"loss:sum": pytest.approx(value), "clipped_tokens:sum": 2.0}


def test_ppo_thresholds_from_config_and_per_position():
    # Wide thresholds: nothing clips, so PPO equals importance sampling.
    wide, metrics, grad = run_loss("ppo", LP, RL, {"clip_low_threshold": 0.1, "clip_high_threshold": 10.0})
    is_value, _, is_grad = run_loss("importance_sampling", LP, RL)
    assert (wide, grad) == (pytest.approx(is_value), pytest.approx(is_grad))
    assert metrics["clipped_tokens:sum"] == 0.0
    # Per-position thresholds (loss_fn_inputs keys the SDK knows) override the config scalars:
    # only position 1 keeps the default [0.8, 1.2].
    per_pos = {"clip_low_threshold": [0.1, 0.8, 0.1, 0.1, 0.1], "clip_high_threshold": [10.0, 1.2, 10.0, 10.0, 10.0]}
    value, metrics, grad = run_loss("ppo", LP, RL | per_pos, {"clip_low_threshold": 0.99, "clip_high_threshold": 1.01})
    assert value == pytest.approx(-(1 + 2.4 - EM5 + EM5 - E5))
    assert grad == pytest.approx([-1.0, 0.0, EM5, -EM5, E5])
    assert metrics["clipped_tokens:sum"] == 1.0


def test_cispo_by_hand():
    value, metrics, grad = run_loss("cispo", LP, RL)
    w = [1.0, 1.2, 0.8, 0.8, 1.2]  # clip(r, 0.8, 1.2), a detached weight
    assert value == pytest.approx(-sum(wi * lpi * ai for wi, lpi, ai in zip(w, LP, A)))
    assert value == pytest.approx(1.6)
    # Every token keeps a gradient, scaled by the clipped ratio: −clip(r)·A (not −r·A).
    assert grad == pytest.approx([-1.0, -2.4, 0.8, -0.8, 1.2])
    assert metrics == {"loss:sum": pytest.approx(1.6), "clipped_tokens:sum": 4.0}


def test_dro_by_hand():
    value, metrics, grad = run_loss("dro", LP, RL, {"beta": 0.1})
    # Σ lp·A = −1.5; ½·β·Σ(lp − q)² = 0.05 · 4 · 0.25 = 0.05.
    assert value == pytest.approx(-(-1.5 - 0.05))
    assert grad == pytest.approx([-1.0, -1.95, 0.95, -1.05, 1.05])  # −A + β·(lp − q)
    assert metrics == {"loss:sum": pytest.approx(1.55)}


def test_gspo_by_hand():
    # Two datums: positions 0-2 and 3-4. Position 0 is outside the mask; its lp − q = 2 must not
    # enter datum 0's ratio. Sequence log-ratios: mean(0.2, 0.4) = 0.3 and mean(−0.5, −0.1) = −0.3.
    loss = get_loss("gspo")
    lp = torch.full((5,), -1.0, dtype=torch.float64, requires_grad=True)
    inputs = {
        "target_tokens": torch.zeros(5, dtype=torch.long),
        DATUM_INDEX: torch.tensor([0, 0, 0, 1, 1]),
        "logprobs": torch.tensor([-3.0, -1.2, -1.4, -0.5, -0.9], dtype=torch.float64),
        "advantages": torch.tensor([0.0, 1.0, -1.0, 1.0, -1.0], dtype=torch.float64),
        "sequence_ratio_mask": torch.tensor([0.0, 1.0, 1.0, 1.0, 1.0], dtype=torch.float64),
    }
    value, metrics = loss(lp, inputs, loss.resolve_config({}))
    (grad,) = torch.autograd.grad(value, lp)
    s0, s1 = math.exp(0.3), math.exp(-0.3)  # 1.35 > 1.2 and 0.74 < 0.8
    # Terms: 0, min(s0, 1.2)=1.2 (clipped), min(−s0, −1.2)=−s0, min(s1, 0.8)=s1, min(−s1, −0.8)=−0.8 (clipped).
    assert value.item() == pytest.approx(-(1.2 - s0 + s1 - 0.8))
    # Each token's gradient is its own: −s·A where unclipped, 0 where clipped; nothing flows
    # between positions through the (detached) sequence mean.
    assert grad.tolist() == pytest.approx([0.0, 0.0, s0, -s1, 0.0])
    assert metrics == {"loss:sum": pytest.approx(value.item()), "clipped_tokens:sum": 2.0}


def test_gspo_refuses_a_datum_without_ratio_positions():
    loss = get_loss("gspo")
    inputs = {
        "target_tokens": torch.zeros(3, dtype=torch.long),
        DATUM_INDEX: torch.tensor([0, 1, 1]),
        "logprobs": torch.zeros(3),
        "advantages": torch.ones(3),
        "sequence_ratio_mask": torch.tensor([1.0, 0.0, 0.0]),
    }
    with pytest.raises(UserError, match="datum 1: gspo's sequence_ratio_mask marks no position"):
        loss(torch.zeros(3), inputs, loss.resolve_config({}))


@pytest.mark.parametrize("name", ["importance_sampling", "ppo", "cispo", "dro"])
def test_on_policy_gradient_is_reinforce(name):
    """At lp = q every ratio is 1 (nothing clips, DRO's penalty has zero slope): d loss / d lp = −A."""
    config = {"beta": 0.3} if name == "dro" else {}
    _, _, grad = run_loss(name, Q, RL, config)
    assert grad == pytest.approx([-a for a in A])


def test_registry_lists_the_losses_and_refuses_the_rest():
    assert supported_losses() == ["cispo", "cross_entropy", "custom", "dro", "gspo", "importance_sampling", "ppo",
                                  "stable_reinforce"]
    # `custom` runs only with an uploaded loss on the op (engine/losses/custom.py), never by name alone.
    with pytest.raises(UserError, match="'custom' is not supported.*create_custom_loss.*loss_id") as e:
        get_loss("custom")
    assert "supported: cispo, cross_entropy, custom, dro, gspo, importance_sampling, ppo, stable_reinforce" in str(e.value)
    with pytest.raises(UserError, match="'reinforce' is not supported by this server \\(supported: "):
        get_loss("reinforce")


def test_config_errors_are_the_callers():
    with pytest.raises(UserError, match=r"dro needs loss_fn_config \['beta'\]"):
        get_loss("dro").resolve_config({})
    with pytest.raises(UserError, match="'beta'.*not used by ppo"):
        get_loss("ppo").resolve_config({"beta": 0.1})
    with pytest.raises(UserError, match="must be a number"):
        run_loss("ppo", LP, RL, {"clip_low_threshold": "tight"})
    with pytest.raises(UserError, match="clip_low_threshold <= clip_high_threshold"):
        run_loss("cispo", LP, RL, {"clip_low_threshold": 1.5, "clip_high_threshold": 1.2})


# --- through the engine: each loss's gradient is exactly d loss / d logprobs, applied by the model ---


@pytest.fixture(scope="module")
def loss_model(engine):
    return create_model(engine, "loss-model", seed=9)


@pytest.mark.parametrize("name", ["importance_sampling", "ppo", "cispo", "dro", "gspo"])
def test_engine_applies_exactly_the_loss_gradient(engine, loss_model, name):
    """forward_backward(loss) leaves the same adapter grads as cross_entropy with weights = −dL/dlp,
    where dL/dlp is autograd of the same loss on the forward's logprobs (what forward_backward_custom
    does client-side). The sampler log-probs are perturbed so ratios leave PPO's clip range."""
    rng = np.random.default_rng(3)
    tokens = [rng.integers(0, 150_000, n) for n in (7, 4)]
    targets = [rng.integers(0, 150_000, len(t)) for t in tokens]
    ce = [Datum(tokens=t, loss_fn_inputs={"target_tokens": tt}) for t, tt in zip(tokens, targets)]
    fwd = step(engine, ForwardBackwardOp(loss_model, ce, "cross_entropy", forward_only=True))
    lps = [o["logprobs"] for o in fwd.loss_fn_outputs]

    data = []
    # A per-datum offset moves GSPO's sequence ratios (e^∓0.4) out of [0.8, 1.2] too.
    for t, tt, lp, offset in zip(tokens, targets, lps, (-0.4, 0.4)):
        inputs = {
            "target_tokens": tt,
            "logprobs": (lp + offset + rng.normal(0, 0.3, len(lp))).astype(np.float32),
            "advantages": rng.normal(size=len(lp)).astype(np.float32),
        }
        if name == "gspo":
            inputs["sequence_ratio_mask"] = (np.arange(len(lp)) > 0).astype(np.float32)
        data.append(Datum(tokens=t, loss_fn_inputs=inputs))
    config = {"beta": 0.2} if name == "dro" else {}

    result = step(engine, ForwardBackwardOp(loss_model, data, name, loss_fn_config=config))
    got = take_grads(engine, loss_model)
    for o, lp in zip(result.loss_fn_outputs, lps):
        np.testing.assert_array_equal(o["logprobs"], lp)  # the forward's logprobs, one per target

    # The same loss on the same logprobs, differentiated here.
    loss = get_loss(name)
    lp_t = torch.from_numpy(np.concatenate(lps)).requires_grad_(True)
    inputs = {k: torch.from_numpy(np.concatenate([d.loss_fn_inputs[k] for d in data])) for k in data[0].loss_fn_inputs}
    inputs[DATUM_INDEX] = torch.tensor([0] * 7 + [1] * 4)
    value, metrics = loss(lp_t, inputs, loss.resolve_config(config))
    (g,) = torch.autograd.grad(value, lp_t)
    assert result.metrics == pytest.approx(metrics, rel=1e-6)
    if name in ("ppo", "gspo"):
        assert metrics["clipped_tokens:sum"] > 0  # the clip really removed some gradient here

    assert_grads_close(got, weighted_cross_entropy_grads(engine, loss_model, tokens, targets, split(g, [7, 4])))
