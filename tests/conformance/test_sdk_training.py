"""The unmodified tinker 0.38.0 SDK trains, checkpoints, resumes and samples through a live tinkerd."""

from __future__ import annotations

import numpy as np
import pytest
import tinker
from tinker import types

from tests.conformance.conftest import TINY


def _datum(tokens: list[int], weights: list[float] | None = None) -> types.Datum:
    inputs = {"target_tokens": tokens[1:]}
    inputs["weights"] = weights if weights is not None else [1.0] * (len(tokens) - 1)
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs=inputs)


@pytest.fixture(scope="module")
def sft_data(server):
    tc = tinker.ServiceClient(base_url=server.url, api_key="tml-tinkerd-test")
    tok = tc.create_lora_training_client(base_model=TINY, rank=4).result().get_tokenizer()
    texts = ["The assistant was made by the tinkerd team.", "Paris is the capital of France, said the model."]
    return [_datum(tok.encode(t)) for t in texts]


def _train(tc, data, steps: int, lr: float = 2e-2) -> list[float]:
    """`steps` pipelined forward_backward + optim_step pairs; waits only at the end."""
    futures = []
    for _ in range(steps):
        fb = tc.forward_backward(data, "cross_entropy")
        tc.optim_step(types.AdamParams(learning_rate=lr))
        futures.append(fb)
    return [f.result().metrics["loss:sum"] for f in futures]


def test_sft_loss_falls_over_20_pipelined_steps(service_client, sft_data):
    tc = service_client.create_lora_training_client(base_model=TINY, rank=8, seed=1).result()
    losses = _train(tc, sft_data, 20)
    assert len(losses) == 20
    assert losses[-1] < 0.5 * losses[0], losses
    out = tc.forward(sft_data, "cross_entropy").result()
    # Per-datum logprobs have one value per target token, and loss:sum is their negated sum.
    assert [len(o["logprobs"].tolist()) for o in out.loss_fn_outputs] == [len(d.loss_fn_inputs["target_tokens"].tolist()) for d in sft_data]
    total = -sum(float(np.sum(o["logprobs"].to_numpy())) for o in out.loss_fn_outputs)
    assert out.metrics["loss:sum"] == pytest.approx(total, rel=1e-5)


def test_resume_from_state_with_optimizer_reproduces_losses_exactly(service_client, sft_data):
    tc = service_client.create_lora_training_client(base_model=TINY, rank=8, seed=3).result()
    first = _train(tc, sft_data, 3)
    path = tc.save_state("k3").result().path
    assert path == f"tinker://{tc.model_id}/weights/k3"
    uninterrupted = _train(tc, sft_data, 3)

    resumed_tc = service_client.create_training_client_from_state_with_optimizer(path).result()
    resumed = _train(resumed_tc, sft_data, 3)
    assert resumed == uninterrupted, (first, uninterrupted, resumed)

    # Without optimizer state the weights match (same first loss) but Adam restarts, so later steps differ.
    fresh_opt_tc = service_client.create_training_client_from_state(path).result()
    no_opt = _train(fresh_opt_tc, sft_data, 3)
    assert no_opt[0] == uninterrupted[0]
    assert no_opt[1:] != uninterrupted[1:]


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_legacy_load_state_in_place(service_client, sft_data):
    tc = service_client.create_lora_training_client(base_model=TINY, rank=4, seed=5).result()
    before = tc.forward(sft_data, "cross_entropy").result().metrics["loss:sum"]
    path = tc.save_state("start").result().path
    _train(tc, sft_data, 3)
    tc.load_state(path).result()
    assert tc.forward(sft_data, "cross_entropy").result().metrics["loss:sum"] == before


def test_save_weights_and_sample(service_client, sft_data):
    tc = service_client.create_lora_training_client(base_model=TINY, rank=8, seed=2).result()
    _train(tc, sft_data, 5)
    sampler = tc.save_weights_and_get_sampling_client().result()
    prompt = types.ModelInput.from_ints(sft_data[0].model_input.to_ints()[:5])
    res = sampler.sample(prompt, num_samples=3, sampling_params=types.SamplingParams(max_tokens=6, temperature=0.8, seed=11)).result()
    assert len(res.sequences) == 3
    ids = {s.sequence_id for s in res.sequences}
    assert len(ids) == 3 and None not in ids
    for s in res.sequences:
        assert 1 <= len(s.tokens) <= 6
        assert s.logprobs is not None and len(s.logprobs) == len(s.tokens)
        assert all(lp <= 0 for lp in s.logprobs)
        assert s.stop_reason in ("stop", "length")
        assert s.stop_reason == "stop" or len(s.tokens) == 6
    # Named sampler weights, then a sampling client from that path.
    spath = tc.save_weights_for_sampler("s1").result().path
    assert spath == f"tinker://{tc.model_id}/sampler_weights/s1"
    named = service_client.create_sampling_client(model_path=spath).result()
    greedy = types.SamplingParams(max_tokens=4, temperature=0.0)
    a = named.sample(prompt, 1, greedy).result().sequences[0].tokens
    b = sampler.sample(prompt, 1, greedy).result().sequences[0].tokens
    assert a == b
    logprobs = named.compute_logprobs(prompt).result()
    assert logprobs[0] is None and len(logprobs) == len(prompt.to_ints())


def test_two_training_clients_keep_separate_weights(service_client, sft_data):
    base = service_client.create_sampling_client(base_model=TINY).result()
    a = service_client.create_lora_training_client(base_model=TINY, rank=4, seed=10).result()
    b = service_client.create_lora_training_client(base_model=TINY, rank=16, seed=11).result()
    loss_b_before = b.forward(sft_data, "cross_entropy").result().metrics["loss:sum"]
    losses_a = _train(a, sft_data, 6)
    assert losses_a[-1] < losses_a[0]
    # b never trained: still the base model (B = 0 init), untouched by a's updates.
    assert b.forward(sft_data, "cross_entropy").result().metrics["loss:sum"] == loss_b_before
    prompt = sft_data[0].model_input
    assert b.save_weights_and_get_sampling_client().result().compute_logprobs(prompt).result() == base.compute_logprobs(prompt).result()
    # Interleaved training of both keeps them apart: a's loss keeps falling, b's starts from base.
    fa = a.forward_backward(sft_data, "cross_entropy")
    fb = b.forward_backward(sft_data, "cross_entropy")
    assert fb.result().metrics["loss:sum"] == loss_b_before
    assert fa.result().metrics["loss:sum"] < loss_b_before


def test_an_adapter_of_the_head_alone_trains(service_client, sft_data):
    """train_attn and train_mlp off, train_unembed on: nothing of the body to differentiate (the
    engine once failed every such forward_backward with a server error)."""
    tc = service_client.create_lora_training_client(base_model=TINY, rank=4, seed=3, train_attn=False,
                                                    train_mlp=False, train_unembed=True).result()
    losses = _train(tc, sft_data, 6)
    assert losses[-1] < losses[0], losses


def test_llama_architecture_trains(service_client, sft_data):
    tc = service_client.create_lora_training_client(base_model="tinkerd/tiny-llama", rank=4, seed=1).result()
    losses = _train(tc, sft_data, 8)
    assert losses[-1] < losses[0]
