"""gpt-oss through a live `tinkerd serve` and the unmodified SDK and cookbook.

The server serves `tinkerd/tiny-gpt-oss` (sliding-window layer 0 with a window of 8, full layer
1, attention sinks, 4 interleaved experts top-2; the Qwen3 tokenizer with the Harmony tokens
added). The data are chat conversations rendered by the cookbook's `gpt_oss_no_sysprompt`
renderer (`conversation_to_datum`), every one longer than the window. Shown: the SL loss falls,
the router metrics come back, save_state -> load_state resumes exactly, sampling from saved
weights past the window gives logprobs equal to compute_logprobs, and the export in hosted
Tinker's layout (experts w1/w3/w2, 3-D) merged by the cookbook's build_hf_model (both strategies,
its `fused_interleaved` gpt-oss profile) scores text as tinkerd does; concurrent clients share a
training pass and each gets its run's bits alone. Numbers pinned against HF + PEFT are in
tests/parity/test_gpt_oss_parity.py.
"""

from __future__ import annotations

import pytest
import tinker
import torch
from tinker import types

from tests.conformance.cookbook_merge import assert_merges_equal, download
from tests.conformance.sft import assert_loss_falls_and_resumes_exactly, losses
from tests.serverproc import API_KEY, start_server

GPT_OSS = "tinkerd/tiny-gpt-oss"
LR = 5e-3  # 2e-2 oscillates on this tiny MoE (42.8 -> 21.3 -> 46.4 -> 21.8 in 8 steps); 5e-3 falls smoothly to 0.27
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"},
     {"role": "assistant", "content": "The capital of France is Paris."}],
    [{"role": "user", "content": "Name a colour of the sky."},
     {"role": "assistant", "content": "Blue, on a clear day."}],
]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = start_server(tmp_path_factory.mktemp("tinkerd-gpt-oss"), [GPT_OSS], ["--threads", "1"])
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def renderer(server):
    from tinker_cookbook import renderers
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(server.data_dir / "models" / "tinkerd--tiny-gpt-oss")
    return renderers.get_renderer("gpt_oss_no_sysprompt", tokenizer)


@pytest.fixture(scope="module")
def data(renderer):
    from tinker_cookbook.supervised.data import conversation_to_datum

    out = [conversation_to_datum(chat, renderer, max_length=None) for chat in CHATS]
    assert all(d.model_input.length > 8 for d in out)  # past the sliding window
    return out


def test_sl_loss_falls_router_metrics_and_save_state_resumes_exactly(server, data):
    sc = tinker.ServiceClient(base_url=server.url, api_key=API_KEY)
    caps = tinker.RestClient(base_url=server.url, api_key=API_KEY).get_server_capabilities().result()
    assert [(m.model_name, m.max_context_length) for m in caps.supported_models] == [(GPT_OSS, 4096)]
    tc = sc.create_lora_training_client(base_model=GPT_OSS, rank=4, seed=3).result()
    assert tc.get_info().model_data.arch == "GptOssForCausalLM"
    assert_loss_falls_and_resumes_exactly(sc, tc, data, LR)
    metrics = tc.forward(data, "cross_entropy").result().metrics
    assert 0 < metrics["e_frac_with_tokens:mean"] <= 1 and "e_max_violation:max" in metrics, metrics


@pytest.fixture(scope="module")
def trained(server, data, renderer):
    sc = tinker.ServiceClient(base_url=server.url, api_key=API_KEY)
    tc = sc.create_lora_training_client(base_model=GPT_OSS, rank=4, seed=9).result()
    losses(tc, data, 4, LR)
    sampler = tc.save_weights_and_get_sampling_client().result()
    prompt = renderer.build_generation_prompt(CHATS[0][:1])
    return {"sampler": sampler, "prompt": prompt, "prompt_ids": prompt.to_ints(),
            "reference": sampler.compute_logprobs(prompt).result()[1:],
            "base": sc.create_sampling_client(base_model=GPT_OSS).result().compute_logprobs(prompt).result()[1:],
            "external": tc.save_weights_external("gpt-oss-ext").result().path}


def test_sampling_from_saved_weights_past_the_window_equals_compute_logprobs(trained, renderer):
    sampler, prompt = trained["sampler"], trained["prompt"]
    params = types.SamplingParams(max_tokens=10, temperature=0.0, stop=renderer.get_stop_sequences())
    res = sampler.sample(prompt, 2, params).result()
    for seq in res.sequences:
        assert len(seq.tokens) >= 1
        ids = trained["prompt_ids"] + seq.tokens
        scored = sampler.compute_logprobs(types.ModelInput.from_ints(ids)).result()[len(trained["prompt_ids"]):]
        assert max(abs(a - b) for a, b in zip(seq.logprobs, scored)) < 1e-4
    assert len(trained["prompt_ids"]) + len(res.sequences[0].tokens) > 8


def test_export_is_hosted_layout_and_the_cookbook_merge_equals_the_trained_model(server, trained, tmp_path, monkeypatch):
    from safetensors.torch import load_file
    from tinker_cookbook import weights

    adapter, tensors = download(server, trained["external"], tmp_path / "ext", monkeypatch)
    prefix = "base_model.model.model.layers.0.mlp.experts"
    # lora_A [E, R, in], lora_B [E, out, R], as for every MoE: gpt-oss's interleaving stays inside tinkerd.
    assert {k: tuple(v.shape) for k, v in tensors.items() if k.startswith(prefix)} == {
        f"{prefix}.w1.lora_A.weight": (4, 4, 64), f"{prefix}.w1.lora_B.weight": (4, 40, 4),
        f"{prefix}.w3.lora_A.weight": (4, 4, 64), f"{prefix}.w3.lora_B.weight": (4, 40, 4),
        f"{prefix}.w2.lora_A.weight": (4, 4, 40), f"{prefix}.w2.lora_B.weight": (4, 64, 4),
    }
    assert not any("sinks" in k or "router" in k for k in tensors)
    assert tensors[f"{prefix}.w1.lora_B.weight"].abs().max() > 0 and tensors[f"{prefix}.w3.lora_B.weight"].abs().max() > 0

    reference, base = trained["reference"], trained["base"]
    assert max(abs(a - b) for a, b in zip(reference, base)) > 1e-2  # the comparison below can fail
    base_dir = str(server.data_dir / "models" / "tinkerd--tiny-gpt-oss")
    assert_merges_equal(base_dir, adapter, trained["prompt_ids"], reference, tmp_path)
    # build_lora_adapter (PEFT files for vLLM): per-expert 2-D LoRAs whose products are the trained
    # experts' deltas (w3, the up half, of expert 2 here).
    weights.build_lora_adapter(base_model=base_dir, adapter_path=adapter, output_path=str(tmp_path / "peft"))
    peft_tensors = load_file(tmp_path / "peft" / "adapter_model.safetensors")
    per_expert = f"{prefix}.2.up_proj"
    got = peft_tensors[f"{per_expert}.lora_B.weight"] @ peft_tensors[f"{per_expert}.lora_A.weight"]
    want = tensors[f"{prefix}.w3.lora_B.weight"][2] @ tensors[f"{prefix}.w3.lora_A.weight"][2]
    assert torch.allclose(got, want, atol=1e-7) and want.abs().max() > 0


def test_concurrent_clients_share_a_pass_and_each_equals_its_run_alone(server):
    """Each run's eager attention with sinks and sliding window on its own rows and width, and its
    tokens on an expert as their own GEMMs (engine/cotrain.py); router metrics too."""
    from tests.conformance.test_shared_pass import assert_clients_share_a_pass_as_alone

    assert_clients_share_a_pass_as_alone(server.url, GPT_OSS, router=True)
