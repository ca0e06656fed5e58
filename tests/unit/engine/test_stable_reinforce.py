"""stable_reinforce (docs/losses.md) against hand-computed values and gradients, and through the engine.

One case of 6 positions: position 0 is a prompt target (no recorded sampler log-prob: NaN), 1-5 are
sampled tokens with lp − q = 0.5, −0.5, 1, −1, 0, so r = e^.5, e^−.5 (kept by the default bounds
[0.5, 2]), e, e^−1 (masked: above and below) and 1.
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
from tinkerd.types import Datum, ForwardBackwardOp, StableReinforceConfig

E, E5 = math.e, math.exp(0.5)
NAN = float("nan")
LP = [-1.0, -0.5, -2.0, -0.5, -3.0, -0.7]
Q = [NAN, -1.0, -1.5, -1.5, -2.0, -0.7]
A = [0.0, 2.0, -1.0, 1.0, 1.0, -1.0]


def run(lp=LP, q=Q, a=A, config=None, datum=None):
    loss = get_loss("stable_reinforce")
    lp_t = torch.tensor(lp, dtype=torch.float64, requires_grad=True)
    inputs = {
        "target_tokens": torch.zeros(len(lp), dtype=torch.long),
        "advantages": torch.tensor(a, dtype=torch.float64),
        "sampler_logprobs": torch.tensor(q, dtype=torch.float32),
        DATUM_INDEX: torch.tensor(datum or [0] * len(lp)),
    }
    value, metrics = loss(lp_t, inputs, loss.resolve_config(config or {}))
    (grad,) = torch.autograd.grad(value, lp_t)
    return value.item(), metrics, grad.tolist()


def test_value_gradient_and_metrics_by_hand_without_kl():
    value, metrics, grad = run()
    # Kept: e^.5·2, e^−.5·(−1), 1·(−1); masked: positions 3 and 4; position 0 is not a sampled token.
    assert value == pytest.approx(-(2 * E5 - 1 / E5 - 1))
    assert grad == pytest.approx([0.0, -2 * E5, 1 / E5, 0.0, 0.0, 1.0])  # −m·r·A
    kl = (E5 - 1.5) + (1 / E5 - 0.5) + (E - 2) + 1 / E + 0.0  # Σ r − 1 − log r on sampled tokens
    assert metrics == {"loss:sum": pytest.approx(value), "sampled_tokens:sum": 5.0, "masked_tokens:sum": 2.0,
                       "kl_sampler_learner:sum": pytest.approx(kl)}


def test_kl_term_by_hand():
    k = 0.3
    value, metrics, grad = run(config={"kl_coeff": k})
    kl = (E5 - 1.5) + (1 / E5 - 0.5) + (E - 2) + 1 / E
    assert value == pytest.approx(-(2 * E5 - 1 / E5 - 1) + k * kl)
    # d/dlp of k·(r − 1 − log r) is k·(r − 1), on every sampled token, masked or not.
    assert grad == pytest.approx([0.0, -2 * E5 + k * (E5 - 1), 1 / E5 + k * (1 / E5 - 1), k * (E - 1),
                                  k * (1 / E - 1), 1.0])
    assert metrics["kl_sampler_learner:sum"] == pytest.approx(kl)


def test_bounds_from_config():
    # Wide bounds keep every sampled token: the policy term is importance_sampling over them.
    value, metrics, grad = run(config={"ratio_low": 0.1, "ratio_high": 10.0})
    assert value == pytest.approx(-(2 * E5 - 1 / E5 + E + 1 / E - 1))
    assert grad == pytest.approx([0.0, -2 * E5, 1 / E5, -E, -1 / E, 1.0])
    assert metrics["masked_tokens:sum"] == 0.0


def test_on_policy_it_is_reinforce_and_the_kl_is_zero():
    q = [NAN] + LP[1:]
    value, metrics, grad = run(q=q, config={"kl_coeff": 1.0})
    assert grad == pytest.approx([0.0] + [-a for a in A[1:]])
    assert value == pytest.approx(-sum(A[1:]))
    assert metrics["kl_sampler_learner:sum"] == pytest.approx(0.0)


def test_an_advantage_on_a_prompt_target_is_refused_naming_the_datum():
    with pytest.raises(UserError, match="datum 1: stable_reinforce takes advantages only on sampled tokens"):
        run(a=[0.0, 2.0, -1.0, 1.0, 0.5, -1.0], q=Q[:4] + [NAN, -0.7], datum=[0, 0, 0, 1, 1, 1])


def test_config_is_checked_naming_the_key():
    loss = get_loss("stable_reinforce")
    assert "stable_reinforce" in supported_losses()
    assert loss.resolve_config({}) == {"kl_coeff": 0.0, "ratio_low": 0.5, "ratio_high": 2.0}
    with pytest.raises(UserError, match=r"\['beta'\] are not used by stable_reinforce"):
        StableReinforceConfig.parse({"beta": 0.1})
    with pytest.raises(UserError, match="'kl_coeff'.*must be >= 0"):
        StableReinforceConfig.parse({"kl_coeff": -0.1})
    with pytest.raises(UserError, match="'kl_coeff'.*finite number"):
        StableReinforceConfig.parse({"kl_coeff": "high"})
    with pytest.raises(UserError, match="ratio_low.*<= 1 <=.*ratio_high"):
        StableReinforceConfig.parse({"ratio_low": 1.5})
    with pytest.raises(UserError, match="'kl_coeff'.*finite"):
        run(config={"kl_coeff": float("inf")})


# --- through the engine ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def sr_model(engine):
    return create_model(engine, "sr-model", seed=11)


def test_engine_applies_exactly_the_loss_gradient_from_the_recorded_logprobs(engine, sr_model):
    """The engine uses Datum.sampler_logprobs (the server's record), not the client's `logprobs`, and
    leaves the grads of cross_entropy with weights = −dL/dlp computed here on its own logprobs."""
    rng = np.random.default_rng(4)
    tokens = [rng.integers(0, 150_000, n) for n in (7, 5)]
    targets = [rng.integers(0, 150_000, len(t)) for t in tokens]
    fwd = step(engine, ForwardBackwardOp(sr_model, [Datum(tokens=t, loss_fn_inputs={"target_tokens": tt})
                                                      for t, tt in zip(tokens, targets)], "cross_entropy", forward_only=True))
    lps = [o["logprobs"] for o in fwd.loss_fn_outputs]  # fp32, as the engine computes the loss
    data, qs, advs = [], [], []
    for t, tt, lp in zip(tokens, targets, lps):
        q = (lp + rng.normal(0, 0.6, len(lp))).astype(np.float32)  # some ratios leave [0.5, 2]
        q[:2] = np.nan  # two prompt targets
        adv = rng.normal(size=len(lp)).astype(np.float32)
        adv[:2] = 0.0
        qs.append(q)
        advs.append(adv)
        # The client's copy is garbage on purpose: it must not be what the loss uses.
        data.append(Datum(tokens=t, loss_fn_inputs={"target_tokens": tt, "advantages": adv,
                                                    "logprobs": np.full(len(lp), -50.0, np.float32)},
                          sampler_logprobs=q))
    config = {"kl_coeff": 0.2}
    result = step(engine, ForwardBackwardOp(sr_model, data, "stable_reinforce", loss_fn_config=config))
    got = take_grads(engine, sr_model)

    lp_t = torch.from_numpy(np.concatenate(lps)).requires_grad_(True)
    q, adv = torch.from_numpy(np.concatenate(qs)), torch.from_numpy(np.concatenate(advs))
    sampled = ~torch.isnan(q)
    r = torch.exp(torch.where(sampled, lp_t - torch.nan_to_num(q), torch.zeros_like(lp_t)))
    m = ((r.detach() >= 0.5) & (r.detach() <= 2.0) & sampled).float()
    reference = -(m * r * adv).sum() + 0.2 * ((r - 1 - torch.log(r)) * sampled).sum()
    (g,) = torch.autograd.grad(reference, lp_t)
    assert result.metrics["loss:sum"] == pytest.approx(reference.item(), rel=1e-5)
    assert 0 < result.metrics["masked_tokens:sum"] < result.metrics["sampled_tokens:sum"] == 8.0

    expected = weighted_cross_entropy_grads(engine, sr_model, tokens, targets, split(g, [7, 5]))
    scale = max(float(e.abs().max()) for e in expected)  # ~18 here: fp32 sums round at ~1e-6 of it
    assert_grads_close(got, expected, atol=1e-6 * scale)


def test_engine_refuses_a_datum_without_the_record_and_a_client_sent_record(engine, sr_model):
    datum = Datum(tokens=np.arange(4), loss_fn_inputs={"target_tokens": np.arange(1, 5), "advantages": np.ones(4, np.float32)})
    with pytest.raises(UserError, match="datum 0: loss_fn stable_reinforce needs provenance"):
        step(engine, ForwardBackwardOp(sr_model, [datum], "stable_reinforce"))
    datum.loss_fn_inputs["sampler_logprobs"] = np.zeros(4, np.float32)
    datum.sampler_logprobs = np.zeros(4, np.float32)
    with pytest.raises(UserError, match=r"loss_fn_inputs \['sampler_logprobs'\] are not used by stable_reinforce"):
        step(engine, ForwardBackwardOp(sr_model, [datum], "stable_reinforce"))
