"""The unmodified SDK against a server started with `--dtype bfloat16`: it trains, samples and
resumes exactly (a bf16 run resumed from save_state equals the bf16 run uninterrupted).

The shared fp32 conformance server serves the same tiny model, so the first loss of the same
adapter on both shows the bf16 server really computes in bf16: close (docs/precision.md), not equal.
"""

from __future__ import annotations

import math

import pytest
import tinker
from tinker import types

from tests.conformance.conftest import TINY
from tests.serverproc import API_KEY, start_server


@pytest.fixture(scope="module")
def bf16_client(tmp_path_factory):
    srv = start_server(tmp_path_factory.mktemp("tinkerd-bf16"), [TINY], ["--threads", "1", "--dtype", "bfloat16"])
    try:
        yield tinker.ServiceClient(base_url=srv.url, api_key=API_KEY)
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def sft_data(bf16_client):
    tok = bf16_client.create_lora_training_client(base_model=TINY, rank=4).result().get_tokenizer()
    texts = ["The assistant was made by the tinkerd team.", "Paris is the capital of France, said the model."]
    data = []
    for text in texts:
        tokens = tok.encode(text)
        data.append(types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                                loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)}))
    return data


def _train(tc, data, steps: int, lr: float = 2e-2) -> list[float]:
    futures = []
    for _ in range(steps):
        futures.append(tc.forward_backward(data, "cross_entropy"))
        tc.optim_step(types.AdamParams(learning_rate=lr))
    return [f.result().metrics["loss:sum"] for f in futures]


def test_bf16_sl_loop_loss_falls_and_stays_near_fp32(bf16_client, service_client, sft_data):
    tc = bf16_client.create_lora_training_client(base_model=TINY, rank=8, seed=1).result()
    losses = _train(tc, sft_data, 10)
    assert all(math.isfinite(x) for x in losses)
    assert losses[-1] < 0.5 * losses[0], losses
    fp32 = service_client.create_lora_training_client(base_model=TINY, rank=8, seed=1).result()
    first32 = fp32.forward(sft_data, "cross_entropy").result().metrics["loss:sum"]
    # Same adapter (seed 1, B = 0), same tokens: only the dtype differs. 2% is ~5x what bf16 moved it.
    assert losses[0] != first32
    assert abs(losses[0] - first32) <= 0.02 * abs(first32), (losses[0], first32)


def test_bf16_sampling(bf16_client, sft_data):
    tc = bf16_client.create_lora_training_client(base_model=TINY, rank=8, seed=2).result()
    _train(tc, sft_data, 5)
    sampler = tc.save_weights_and_get_sampling_client().result()
    prompt = types.ModelInput.from_ints(sft_data[0].model_input.to_ints()[:5])
    res = sampler.sample(prompt, num_samples=3,
                         sampling_params=types.SamplingParams(max_tokens=6, temperature=0.8, seed=11)).result()
    assert len(res.sequences) == 3
    for s in res.sequences:
        assert 1 <= len(s.tokens) <= 6
        assert s.logprobs is not None and len(s.logprobs) == len(s.tokens)
        assert all(math.isfinite(lp) and lp <= 0 for lp in s.logprobs)
    greedy = types.SamplingParams(max_tokens=6, temperature=0.0)
    tokens = sampler.sample(prompt, 1, greedy).result().sequences[0].tokens
    assert tokens == sampler.sample(prompt, 1, greedy).result().sequences[0].tokens  # deterministic in bf16 too
    scored = sampler.compute_logprobs(types.ModelInput.from_ints(prompt.to_ints() + tokens)).result()
    assert scored[0] is None and all(math.isfinite(x) for x in scored[1:])


@pytest.mark.filterwarnings("ignore::FutureWarning")  # load_state_with_optimizer: deprecated, still served
def test_bf16_resume_from_state_equals_uninterrupted(bf16_client, sft_data):
    tc = bf16_client.create_lora_training_client(base_model=TINY, rank=8, seed=3).result()
    _train(tc, sft_data, 3)
    path = tc.save_state("k3").result().path
    uninterrupted = _train(tc, sft_data, 3)
    resumed_tc = bf16_client.create_training_client_from_state_with_optimizer(path).result()
    assert _train(resumed_tc, sft_data, 3) == uninterrupted
    # In place, as the legacy load_state does: the same three losses again.
    tc.load_state_with_optimizer(path).result()
    assert _train(tc, sft_data, 3) == uninterrupted
