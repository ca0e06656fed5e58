"""StableReinforce through the unmodified SDK 0.38: record_stability_info sampling, sequence_ids,
provenance, the loss (docs/losses.md) against a hand computation, and every refusal of misuse.

The client's own `logprobs` are sent wrong on purpose (−5 everywhere): the loss must use what the
sampler recorded, which equals what the sample response carried.
"""

from __future__ import annotations

import subprocess
import sys
import time

import numpy as np
import pytest
import tinker
from tinker import types

from tests.conformance.conftest import RECORDED_SEQUENCE_TTL_S, TINY
from tests.serverproc import API_KEY


def _datum(prompt: list[int], seq: types.SampledSequence, advantage: float, client_logprob: float = -5.0) -> types.Datum:
    """As the cookbook's rl_loop builds it (with_sampled_provenance), prompt targets padded with 0."""
    pad = len(prompt) - 1
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(prompt + seq.tokens[:-1]),
        loss_fn_inputs={
            "target_tokens": [0] * pad + seq.tokens,
            "logprobs": [0.0] * pad + [client_logprob] * len(seq.tokens),
            "advantages": [0.0] * pad + [advantage] * len(seq.tokens),
        },
    )
    sid = seq.sequence_id
    return datum.with_provenance(
        model_input=[types.PromptProvenanceSpan(sequence_id=sid, length=len(prompt)),
                     types.SampledProvenanceSpan(sequence_id=sid, length=len(seq.tokens) - 1)],
        loss_fn_inputs=[types.PromptProvenanceSpan(sequence_id=sid, offset=1, length=pad),
                        types.SampledProvenanceSpan(sequence_id=sid, length=len(seq.tokens))],
    )


def _reference(lp: np.ndarray, q: np.ndarray, adv: np.ndarray, kl_coeff=0.0, low=0.5, high=2.0) -> tuple[float, int]:
    """docs/losses.md in float64 numpy, over sampled tokens only: (loss, masked token count)."""
    r = np.exp(lp - q)
    keep = (r >= low) & (r <= high)
    return float(-(keep * r * adv).sum() + kl_coeff * (r - 1 - np.log(r)).sum()), int((~keep).sum())


def _sample(tc, prompt, n=3, record=True, seed=5, max_tokens=4):
    sampler = tc.save_weights_and_get_sampling_client(record_stability_info=record).result()
    params = types.SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=seed)
    return sampler.sample(types.ModelInput.from_ints(prompt), n, params).result().sequences


def _sampled_part(out, seqs, prompt) -> tuple[np.ndarray, np.ndarray]:
    """The learner's (returned) and the sampler's log-probs of the sampled tokens, concatenated."""
    pad = len(prompt) - 1
    lp = np.concatenate([np.asarray(o["logprobs"].tolist(), np.float64)[pad:] for o in out.loss_fn_outputs])
    q = np.concatenate([np.asarray(s.logprobs, np.float64) for s in seqs])
    return lp, q


@pytest.fixture(scope="module")
def rollout(server):
    sc = tinker.ServiceClient(base_url=server.url, api_key=API_KEY)
    tc = sc.create_lora_training_client(base_model=TINY, rank=4, seed=13).result()
    prompt = tc.get_tokenizer().encode("Count to three:")
    seqs = _sample(tc, prompt)
    return sc, tc, prompt, seqs


def test_sequences_carry_distinct_sequence_ids(rollout):
    _, _, _, seqs = rollout
    ids = [s.sequence_id for s in seqs]
    assert len(set(ids)) == len(ids) == 3 and all(ids)


def test_stable_reinforce_trains_with_the_hand_computed_loss(rollout):
    _, tc, prompt, seqs = rollout
    advantages = [1.0, -0.5, -0.5]
    data = [_datum(prompt, s, a) for s, a in zip(seqs, advantages)]
    adv = np.concatenate([[a] * len(s.tokens) for s, a in zip(seqs, advantages)])

    # On-policy: the learner equals the sampler (r = 1), so the loss is −Σ A and the KL term is 0.
    first = tc.forward_backward(data, "stable_reinforce", {"kl_coeff": 0.1})
    tc.optim_step(types.AdamParams(learning_rate=3e-4))
    first = first.result()
    lp, q = _sampled_part(first, seqs, prompt)
    np.testing.assert_allclose(lp, q, atol=1e-3)
    expected, masked = _reference(lp, q, adv, kl_coeff=0.1)
    assert first.metrics["loss:sum"] == pytest.approx(expected, abs=1e-4)
    assert first.metrics["sampled_tokens:sum"] == len(adv)
    assert first.metrics["masked_tokens:sum"] == masked == 0
    # Computed with the client's (wrong, −5) logprobs instead, the loss would be far from the reported one.
    with_client_copy, _ = _reference(lp, np.full_like(q, -5.0), adv, kl_coeff=0.1)
    assert abs(with_client_copy - first.metrics["loss:sum"]) > 1.0

    # After the step the same sequences are off-policy (ratios of about 0.3 to 3 on the tiny model):
    # the default bounds [0.5, 2] keep some tokens and mask others.
    second = tc.forward(data, "stable_reinforce", {"kl_coeff": 0.1}).result()
    lp, q = _sampled_part(second, seqs, prompt)
    assert np.abs(lp - q).max() > 0.1  # the step moved the learner away from the recorded sampler
    expected, masked = _reference(lp, q, adv, kl_coeff=0.1)
    assert second.metrics["loss:sum"] == pytest.approx(expected, rel=1e-4, abs=1e-4)
    assert second.metrics["masked_tokens:sum"] == masked
    assert second.metrics["kl_sampler_learner:sum"] == pytest.approx(float((np.exp(lp - q) - 1 - (lp - q)).sum()), rel=1e-3, abs=1e-5)
    assert 0 < masked < len(adv), np.exp(lp - q)


def test_stable_reinforce_raises_reward_on_a_learnable_task(service_client):
    """The GRPO task of test_rl_losses with the cookbook's default loss: reward 1 when the one sampled
    token is X, a token the base model gives about 10%; each step samples from the current weights
    with record_stability_info and trains on the recorded sequences."""
    tc = service_client.create_lora_training_client(base_model=TINY, rank=8, seed=0).result()
    prompt = tc.get_tokenizer().encode("The answer is")
    base = service_client.create_sampling_client(base_model=TINY).result()
    probe = base.sample(types.ModelInput.from_ints(prompt + [0]), 1, types.SamplingParams(max_tokens=1),
                        include_prompt_logprobs=True, topk_prompt_logprobs=8).result()
    x, x_logprob = min(probe.topk_prompt_logprobs[-1][1:], key=lambda c: abs(np.exp(c[1]) - 0.1))
    assert 0.03 < np.exp(x_logprob) < 0.3
    curve = []
    for step in range(12):
        seqs = _sample(tc, prompt, n=16, seed=step, max_tokens=1)
        rewards = np.array([float(s.tokens[0] == x) for s in seqs])
        curve.append(rewards.mean())
        data = [_datum(prompt, s, float(a)) for s, a in zip(seqs, rewards - rewards.mean())]
        fb = tc.forward_backward(data, "stable_reinforce")
        tc.optim_step(types.AdamParams(learning_rate=1e-4))
        assert fb.result().metrics["masked_tokens:sum"] == 0  # on-policy: every ratio is 1
    final = _sample(tc, prompt, n=64, seed=999, max_tokens=1)
    final_reward = float(np.mean([s.tokens[0] == x for s in final]))
    print(f"stable_reinforce reward curve {[round(float(c), 3) for c in curve]}, final {final_reward:.3f}")
    assert np.mean(curve[:2]) < 0.35, curve
    assert final_reward >= 0.8, (curve, final_reward)


def test_capabilities_list_stable_reinforce(server):
    import httpx

    raw = httpx.get(f"{server.url}/api/v1/get_server_capabilities", headers={"X-API-Key": API_KEY}).json()
    assert "stable_reinforce" in raw["supported_loss_fns"]


def _refused(tc, data, *words, config=None) -> None:
    with pytest.raises(tinker.BadRequestError) as info:
        tc.forward_backward(data, "stable_reinforce", config).result()
    for w in words:
        assert w in str(info.value), info.value


def test_misuse_is_a_400_naming_the_datum(rollout):
    _, tc, prompt, seqs = rollout
    good = _datum(prompt, seqs[0], 1.0)
    no_provenance = types.Datum(model_input=good.model_input, loss_fn_inputs=good.loss_fn_inputs)
    _refused(tc, [good, no_provenance], "datum 1", "needs provenance")
    unknown = _datum(prompt, types.SampledSequence(stop_reason="length", sequence_id="req-0000:0", tokens_np=np.asarray(seqs[1].tokens)), 1.0)
    _refused(tc, [good, unknown], "datum 1", "'req-0000:0' was not sampled in this session")
    # Targets that are not the tokens the sequence sampled, and lengths that do not tile.
    wrong = types.SampledSequence(stop_reason="length", sequence_id=seqs[0].sequence_id,
                                  tokens_np=np.asarray([t + 1 for t in seqs[0].tokens]))
    _refused(tc, [_datum(prompt, wrong, 1.0)], "datum 0", "are not the", seqs[0].sequence_id)
    longer = types.SampledSequence(stop_reason="length", sequence_id=seqs[0].sequence_id,
                                   tokens_np=np.asarray(seqs[0].tokens + [7]))
    _refused(tc, [_datum(prompt, longer, 1.0)], "datum 0", "outside")
    # An advantage on a prompt target; a bad config.
    d = _datum(prompt, seqs[0], 1.0)
    adv = d.loss_fn_inputs["advantages"].to_numpy().copy()
    adv[0] = 1.0
    _refused(tc, [types.Datum(model_input=d.model_input, loss_fn_inputs={**d.loss_fn_inputs, "advantages": adv},
                              model_input_spans=d.model_input_spans, loss_fn_input_spans=d.loss_fn_input_spans)],
             "datum 0", "advantages only on sampled tokens")
    _refused(tc, [good], "kl_coeff", config={"kl_coeff": -1.0})
    _refused(tc, [good], "['beta'] are not used by stable_reinforce", config={"beta": 0.1})
    # A sequence sampled without record_stability_info was never recorded.
    plain = _sample(tc, prompt, n=1, record=False)[0]
    _refused(tc, [_datum(prompt, plain, 1.0)], f"'{plain.sequence_id}' was not sampled in this session")


def test_another_sessions_and_another_accounts_sequences_are_refused(server, rollout):
    _, _, prompt, seqs = rollout
    # Same account, another session (a second ServiceClient): provenance works only within one session.
    other = tinker.ServiceClient(base_url=server.url, api_key=API_KEY)
    tc2 = other.create_lora_training_client(base_model=TINY, rank=4, seed=13).result()
    _refused(tc2, [_datum(prompt, seqs[0], 1.0)], "datum 0", f"'{seqs[0].sequence_id}' was not sampled in this session")
    # Another account: the same answer, nothing tells it the sequence exists.
    out = subprocess.run([sys.executable, "-m", "tinkerd.cli.main", "keys", "--data-dir", str(server.data_dir), "create",
                          "--name", "eve-sr", "--account", "eve-stable"], capture_output=True, text=True, check=True)
    key = out.stdout.split("TINKER_API_KEY=")[1].split()[0]
    eve = tinker.ServiceClient(base_url=server.url, api_key=key)
    tc3 = eve.create_lora_training_client(base_model=TINY, rank=4).result()
    _refused(tc3, [_datum(prompt, seqs[0], 1.0)], "datum 0", f"'{seqs[0].sequence_id}' was not sampled in this session")


def test_record_stability_info_without_a_session_is_refused(server):
    import httpx

    body = {"base_model": TINY, "num_samples": 1, "prompt": {"chunks": [{"type": "encoded_text", "tokens": [1, 2]}]},
            "sampling_params": {"max_tokens": 2}, "record_stability_info": True}
    r = httpx.post(f"{server.url}/api/v1/asample", json=body, headers={"X-API-Key": API_KEY}, timeout=30)
    assert r.status_code == 400 and "needs a sampling_session_id" in r.json()["error"], r.text


# --- expiry: a server whose records live 6 s ------------------------------------------------------

TTL_S = RECORDED_SEQUENCE_TTL_S


@pytest.fixture(scope="module")
def short_ttl_server(timers_server):
    """Recorded sequences kept TTL_S: the shared timers server (conftest.py)."""
    return timers_server


def test_a_sequence_expires_a_ttl_after_its_last_use(short_ttl_server):
    sc = tinker.ServiceClient(base_url=short_ttl_server.url, api_key=API_KEY)
    tc = sc.create_lora_training_client(base_model=TINY, rank=4, seed=1).result()
    prompt = tc.get_tokenizer().encode("Hi")
    seq = _sample(tc, prompt, n=1)[0]
    sampled_at = time.monotonic()
    data = [_datum(prompt, seq, 1.0)]
    for _ in range(2):  # each use restarts the TTL: the second use is past the first TTL since sampling
        time.sleep(TTL_S * 0.6)
        tc.forward(data, "stable_reinforce").result()
    assert time.monotonic() - sampled_at > TTL_S
    time.sleep(TTL_S + 1)
    _refused(tc, data, "datum 0", "has expired", "after sampling or their last use")
