"""RL losses, provenance, soft targets and forward_backward_custom through the unmodified SDK.

A GRPO loop with `importance_sampling` on a toy verifiable task must raise its reward; every loss
must return per-datum logprobs and the `loss:sum` its formula gives on them; the client-side custom
loss path must apply exactly the gradient the client computed.
"""

from __future__ import annotations

import httpx
import numpy as np
import pytest
import tinker
import torch
from tinker import types

from tests.conformance.conftest import TINY
from tests.conformance.refusals import failed_as_user
from tests.serverproc import API_KEY

# Adam with eps=1: the first update is lr·g/(|g|+1) ≈ lr·g, so it depends on the gradient's size
# and not only its sign — two paths whose gradients differ show up in the weights.
SMOOTH_ADAM = types.AdamParams(learning_rate=1e-2, eps=1.0)


# --- GRPO with importance_sampling on a verifiable toy task ---------------------------------------


def test_grpo_importance_sampling_raises_reward(service_client):
    """Reward = 1 when the one sampled token is X, a token the base model gives about 10%."""
    tc = service_client.create_lora_training_client(base_model=TINY, rank=8, seed=0).result()
    prompt = tc.get_tokenizer().encode("The answer is")
    # The next-token distribution after the prompt is the top-k of the prompt position that predicts
    # an appended dummy token.
    base = service_client.create_sampling_client(base_model=TINY).result()
    probe = base.sample(types.ModelInput.from_ints(prompt + [0]), 1, types.SamplingParams(max_tokens=1),
                        include_prompt_logprobs=True, topk_prompt_logprobs=8).result()
    candidates = probe.topk_prompt_logprobs[-1][1:]  # not the mode
    x, x_logprob = min(candidates, key=lambda c: abs(np.exp(c[1]) - 0.1))
    assert 0.03 < np.exp(x_logprob) < 0.3, candidates

    model_input = types.ModelInput.from_ints(prompt)
    pad = len(prompt) - 1
    curve = []
    for step in range(12):
        sampler = tc.save_weights_and_get_sampling_client().result()
        group = sampler.sample(model_input, 16, types.SamplingParams(max_tokens=1, temperature=1.0, seed=step)).result()
        rewards = np.array([float(s.tokens[0] == x) for s in group.sequences])
        curve.append(rewards.mean())
        advantages = rewards - rewards.mean()  # group-relative, as GRPO
        data = [
            types.Datum(model_input=model_input, loss_fn_inputs={
                "target_tokens": prompt[1:] + [s.tokens[0]],
                "logprobs": [0.0] * pad + [s.logprobs[0]],
                "advantages": [0.0] * pad + [float(a)],
            })
            for s, a in zip(group.sequences, advantages)
        ]
        fb = tc.forward_backward(data, "importance_sampling")
        tc.optim_step(types.AdamParams(learning_rate=1e-4))
        out = fb.result()
        learner = np.array([o["logprobs"].tolist()[-1] for o in out.loss_fn_outputs])
        sampled = np.array([s.logprobs[0] for s in group.sequences])
        # On-policy: the learner scores the sampled token as the sampler did (ratio 1), so the loss is
        # −Σ A = 0 for centred advantages.
        np.testing.assert_allclose(learner, sampled, atol=1e-3)
        assert out.metrics["loss:sum"] == pytest.approx(-float(np.sum(np.exp(learner - sampled) * advantages)), abs=1e-4)

    final_sampler = tc.save_weights_and_get_sampling_client().result()
    final = final_sampler.sample(model_input, 64, types.SamplingParams(max_tokens=1, temperature=1.0, seed=999)).result()
    final_reward = float(np.mean([s.tokens[0] == x for s in final.sequences]))
    print(f"GRPO reward curve {[round(float(c), 3) for c in curve]}, final {final_reward:.3f}")
    assert np.mean(curve[:2]) < 0.35, curve
    assert np.mean(curve[-3:]) > np.mean(curve[:3]) + 0.4, curve
    assert final_reward >= 0.8, (curve, final_reward)


# --- every loss by name: per-datum logprobs and the loss its formula gives -------------------------


def _reference(name: str, lp: np.ndarray, q: np.ndarray, adv: np.ndarray, datum: np.ndarray, mask, config) -> float:
    """The loss formulas of protocol §8, in float64 numpy, on the logprobs the server returned."""
    r = np.exp(lp - q)
    lo, hi = config.get("clip_low_threshold", 0.8), config.get("clip_high_threshold", 1.2)
    if name == "importance_sampling":
        return float(-(r * adv).sum())
    if name == "ppo":
        return float(-np.minimum(r * adv, np.clip(r, lo, hi) * adv).sum())
    if name == "cispo":
        return float(-(np.clip(r, lo, hi) * lp * adv).sum())
    if name == "dro":
        return float(-(lp * adv - 0.5 * config["beta"] * (lp - q) ** 2).sum())
    if name == "gspo":
        seq = np.array([(lp - q)[(datum == d) & (mask != 0)].mean() for d in range(datum.max() + 1)])
        s = np.exp(seq[datum])
        return float(-np.minimum(s * adv, np.clip(s, lo, hi) * adv).sum())
    raise AssertionError(name)


@pytest.fixture(scope="module")
def rl_batch(server):
    """Two datums with sampler logprobs shifted from the learner's so ratios leave [0.8, 1.2]."""
    sc = tinker.ServiceClient(base_url=server.url, api_key=API_KEY)
    tc = sc.create_lora_training_client(base_model=TINY, rank=4, seed=7).result()
    rng = np.random.default_rng(0)
    seqs = [rng.integers(0, 150_000, n).tolist() for n in (9, 5)]
    plain = [types.Datum(model_input=types.ModelInput.from_ints(s[:-1]), loss_fn_inputs={"target_tokens": s[1:]}) for s in seqs]
    lps = [np.array(o["logprobs"].tolist()) for o in tc.forward(plain, "cross_entropy").result().loss_fn_outputs]
    data = []
    for s, lp, offset in zip(seqs, lps, (0.4, -0.4)):
        n = len(lp)
        data.append({
            "model_input": types.ModelInput.from_ints(s[:-1]),
            "target_tokens": s[1:],
            "logprobs": (lp + offset + rng.normal(0, 0.3, n)).astype(np.float32),
            "advantages": rng.normal(size=n).astype(np.float32),
            "sequence_ratio_mask": (np.arange(n) >= 2).astype(np.float32),
        })
    return tc, data


@pytest.mark.parametrize(
    "name, config",
    [
        ("importance_sampling", {}),
        ("ppo", {}),
        ("ppo", {"clip_low_threshold": 0.9, "clip_high_threshold": 1.05}),
        ("cispo", {}),
        ("dro", {"beta": 0.05}),
        ("gspo", {}),
    ],
)
def test_loss_by_name_matches_its_formula(rl_batch, name, config):
    tc, raw = rl_batch
    keys = ["target_tokens", "logprobs", "advantages"] + (["sequence_ratio_mask"] if name == "gspo" else [])
    data = [types.Datum(model_input=d["model_input"], loss_fn_inputs={k: d[k] for k in keys}) for d in raw]
    out = tc.forward(data, name, config or None).result()
    lps = [np.array(o["logprobs"].tolist(), dtype=np.float64) for o in out.loss_fn_outputs]
    assert [len(lp) for lp in lps] == [len(d["target_tokens"]) for d in raw]

    def cat(key: str) -> np.ndarray:
        return np.concatenate([np.asarray(d[key], np.float64) for d in raw])

    lp = np.concatenate(lps)
    datum = np.repeat(np.arange(len(raw)), [len(x) for x in lps])
    expected = _reference(name, lp, cat("logprobs"), cat("advantages"), datum, cat("sequence_ratio_mask"), config)
    assert out.metrics["loss:sum"] == pytest.approx(expected, rel=1e-4, abs=1e-4)
    assert all(k.count(":") == 1 for k in out.metrics)
    if name in ("ppo", "cispo", "gspo"):
        assert out.metrics["clipped_tokens:sum"] >= 1  # the shifted ratios really were clipped


def test_refused_losses_are_user_errors_naming_the_supported_ones(rl_batch):
    tc, raw = rl_batch
    data = [types.Datum(model_input=d["model_input"], loss_fn_inputs={k: d[k] for k in ("target_tokens", "logprobs", "advantages")}) for d in raw]
    failed_as_user(tc.forward_backward(data, "gspo"), "sequence_ratio_mask")
    failed_as_user(tc.forward_backward(data, "dro"), "beta")


def test_capabilities_list_the_losses(server):
    # The SDK's typed response drops unknown keys (pydantic extra="ignore") but must still parse.
    caps = tinker.RestClient(base_url=server.url, api_key=API_KEY).get_server_capabilities().result()
    assert TINY in [m.model_name for m in caps.supported_models]
    raw = httpx.get(f"{server.url}/api/v1/get_server_capabilities", headers={"X-API-Key": API_KEY}).json()
    assert raw["supported_loss_fns"] == ["cispo", "cross_entropy", "custom", "dro", "gspo", "importance_sampling", "ppo", "stable_reinforce"]


# --- provenance spans: accepted, and ignored by every loss that does not use them -----------------


def test_provenance_spans_are_accepted_and_ignored(service_client):
    tc = service_client.create_lora_training_client(base_model=TINY, rank=4, seed=3).result()
    tokenizer = tc.get_tokenizer()
    prompt = tokenizer.encode("Name a colour:")
    sampler = tc.save_weights_and_get_sampling_client().result()
    seqs = sampler.sample(types.ModelInput.from_ints(prompt), 2, types.SamplingParams(max_tokens=4, temperature=1.0, seed=1)).result().sequences
    plain, spanned = [], []
    for s in seqs:
        full = prompt + s.tokens
        n_prompt_targets = len(prompt) - 1
        datum = types.Datum(model_input=types.ModelInput.from_ints(full[:-1]), loss_fn_inputs={
            "target_tokens": full[1:],
            "logprobs": [0.0] * n_prompt_targets + s.logprobs,
            "advantages": [0.0] * n_prompt_targets + [1.0] * len(s.tokens),
        })
        plain.append(datum)
        # As the cookbook's rl/data_processing builds them: the inputs are the prompt then all but the
        # last sampled token; the targets are the prompt from position 1 then every sampled token.
        spanned.append(datum.with_provenance(
            model_input=[types.PromptProvenanceSpan(sequence_id=s.sequence_id, length=len(prompt)),
                         types.SampledProvenanceSpan(sequence_id=s.sequence_id, length=len(s.tokens) - 1)],
            loss_fn_inputs=[types.PromptProvenanceSpan(sequence_id=s.sequence_id, offset=1, length=n_prompt_targets),
                            types.SampledProvenanceSpan(sequence_id=s.sequence_id, length=len(s.tokens))],
        ))
    for loss_fn in ("importance_sampling", "ppo"):
        with_spans = tc.forward_backward(spanned, loss_fn).result()
        without = tc.forward_backward(plain, loss_fn).result()
        assert with_spans.metrics == without.metrics
        assert [o["logprobs"].tolist() for o in with_spans.loss_fn_outputs] == [o["logprobs"].tolist() for o in without.loss_fn_outputs]


# --- soft (N, K) targets: sparse CSR on the wire, (N, K) logprobs back ----------------------------


def _soft_datum(seq: list[int], rng, k: int = 6) -> types.Datum:
    """Mostly-empty [N, K] targets and weights as torch tensors, which the SDK sends as CSR."""
    n = len(seq) - 1
    targets = torch.zeros(n, k, dtype=torch.long)
    weights = torch.zeros(n, k)
    targets[:, 0] = torch.tensor(seq[1:])
    weights[:, 0] = 1.0
    targets[1, 2] = int(rng.integers(1, 150_000))
    weights[1, 2] = -0.5
    return types.Datum(model_input=types.ModelInput.from_ints(seq[:-1]), loss_fn_inputs={"target_tokens": targets, "weights": weights})


def test_soft_targets_travel_sparse_and_return_n_by_k(service_client):
    tc = service_client.create_lora_training_client(base_model=TINY, rank=4, seed=4).result()
    rng = np.random.default_rng(5)
    data = [_soft_datum(rng.integers(0, 150_000, n).tolist(), rng) for n in (7, 5)]
    for d in data:
        for key in ("target_tokens", "weights"):
            assert d.loss_fn_inputs[key].sparse_crow_indices is not None, key  # really CSR on the wire
    out = tc.forward(data, "cross_entropy").result()
    total = 0.0
    for d, o in zip(data, out.loss_fn_outputs):
        targets = d.loss_fn_inputs["target_tokens"].to_torch()
        lp = o["logprobs"].to_torch()
        assert tuple(lp.shape) == tuple(targets.shape)  # (N, K)
        # Column by column equals scoring those targets as plain 1-D cross-entropy targets.
        for col in range(targets.shape[1]):
            one_d = types.Datum(model_input=d.model_input, loss_fn_inputs={"target_tokens": targets[:, col].tolist()})
            ref = tc.forward([one_d], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].tolist()
            np.testing.assert_allclose(lp[:, col].numpy(), ref, rtol=1e-5, atol=1e-5)
        total -= float((lp.double() * d.loss_fn_inputs["weights"].to_torch().double()).sum())
    assert out.metrics["loss:sum"] == pytest.approx(total, rel=1e-5, abs=1e-4)


# --- forward_backward_custom (client-side in SDK 0.38): exactly the client's gradient -------------


def _is_custom_loss(data, logprobs_list):
    """importance_sampling written as a client-side custom loss."""
    loss = sum(
        -(torch.exp(lp - d.loss_fn_inputs["logprobs"].to_torch()) * d.loss_fn_inputs["advantages"].to_torch()).sum()
        for d, lp in zip(data, logprobs_list)
    )
    return loss, {"custom_terms:sum": float(sum(lp.numel() for lp in logprobs_list))}


def _soft_ce_custom_loss(data, logprobs_list):
    """Soft-target cross-entropy over (N, K) logprobs, written as a client-side custom loss."""
    loss = sum(-(lp * d.loss_fn_inputs["weights"].to_torch()).sum() for d, lp in zip(data, logprobs_list))
    return loss, {}


def _rl_data(raw) -> list[types.Datum]:
    return [types.Datum(model_input=d["model_input"], loss_fn_inputs={k: d[k] for k in ("target_tokens", "logprobs", "advantages")}) for d in raw]


@pytest.mark.parametrize("case", ["importance_sampling_1d", "soft_cross_entropy_2d_sparse"])
def test_forward_backward_custom_applies_the_client_gradient(service_client, rl_batch, case):
    """One step through forward_backward_custom and one through the equivalent built-in loss, from
    identical adapters, leave identical models: the server applied exactly the client's gradient."""
    if case == "importance_sampling_1d":
        custom_data = builtin_data = _rl_data(rl_batch[1])
        custom_fn, builtin = _is_custom_loss, "importance_sampling"
    else:
        rng = np.random.default_rng(8)
        custom_data = [_soft_datum(rng.integers(0, 150_000, n).tolist(), rng) for n in (8, 6)]
        # The built-in path gets the same (N, K) tensors dense (numpy), so CSR and dense decoding meet.
        builtin_data = [
            types.Datum(model_input=d.model_input, loss_fn_inputs={k: v.to_numpy() for k, v in d.loss_fn_inputs.items()})
            for d in custom_data
        ]
        custom_fn, builtin = _soft_ce_custom_loss, "cross_entropy"
    probe = [types.Datum(model_input=d.model_input, loss_fn_inputs={"target_tokens": d.loss_fn_inputs["target_tokens"]}) for d in builtin_data]

    via_custom = service_client.create_lora_training_client(base_model=TINY, rank=4, seed=21).result()
    via_builtin = service_client.create_lora_training_client(base_model=TINY, rank=4, seed=21).result()
    before = [o["logprobs"].to_numpy() for o in via_custom.forward(probe, "cross_entropy").result().loss_fn_outputs]

    custom = via_custom.forward_backward_custom(custom_data, custom_fn)
    via_custom.optim_step(SMOOTH_ADAM)
    reference = via_builtin.forward_backward(builtin_data, builtin)
    via_builtin.optim_step(SMOOTH_ADAM)
    custom, reference = custom.result(), reference.result()

    # The forward returned the learner's logprobs, the same ones the built-in loss saw; the custom
    # result reports the client's loss as loss:sum and the server's linear surrogate beside it.
    for c, r in zip(custom.loss_fn_outputs, reference.loss_fn_outputs):
        np.testing.assert_array_equal(c["logprobs"].to_numpy(), r["logprobs"].to_numpy())
    assert custom.metrics["loss:sum"] == pytest.approx(reference.metrics["loss:sum"], rel=1e-5, abs=1e-5)
    assert "surrogate_loss:sum" in custom.metrics

    after_custom = [o["logprobs"].to_numpy() for o in via_custom.forward(probe, "cross_entropy").result().loss_fn_outputs]
    after_builtin = [o["logprobs"].to_numpy() for o in via_builtin.forward(probe, "cross_entropy").result().loss_fn_outputs]
    moved = max(float(np.abs(a - b).max()) for a, b in zip(after_builtin, before))
    assert moved > 1e-2, moved  # the step really changed the model, far beyond the tolerance below
    for a, b in zip(after_custom, after_builtin):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-5)
