"""tinker-cookbook's weights tools against tinkerd: download (plain and age-encrypted routes), then
build_lora_adapter / build_hf_model, whose models must score text like tinkerd's own sampler."""

from __future__ import annotations

import pytest
import tinker
import torch
from tinker import types

from tests.conformance.conftest import TINY
from tests.conformance.sft import train_on
from tests.serverproc import API_KEY

weights = pytest.importorskip("tinker_cookbook.weights")
peft = pytest.importorskip("peft")
from tinker_cookbook.exceptions import WeightsDownloadError  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

TOKENS = list(range(2000, 2020))
PROMPT = [3000, 2000, 2001, 2002, 2003, 2004, 2005, 2006, 17, 2010, 2011, 99, 5]
FILES = ["adapter_config.json", "adapter_model.safetensors"]


def _logprobs(model, tokens: list[int]) -> torch.Tensor:
    """Per-token logprobs of tokens[1:], as compute_logprobs reports them."""
    with torch.no_grad():
        logits = model(torch.tensor([tokens])).logits[0, :-1].float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(tokens[1:])[:, None])[:, 0]


@pytest.fixture(scope="module")
def trained(server):
    sc = tinker.ServiceClient(base_url=server.url, api_key=API_KEY)
    tc = sc.create_lora_training_client(base_model=TINY, rank=4, seed=9).result()
    train_on(tc, TOKENS, 3, learning_rate=2e-2)
    state = tc.save_state("final").result().path
    sampler_path = tc.save_weights_for_sampler("final").result().path
    sampler = sc.create_sampling_client(model_path=sampler_path).result()
    reference = torch.tensor(sampler.compute_logprobs(types.ModelInput.from_ints(PROMPT)).result()[1:])
    base = sc.create_sampling_client(base_model=TINY).result()
    base_reference = torch.tensor(base.compute_logprobs(types.ModelInput.from_ints(PROMPT)).result()[1:])
    # The test must be able to fail: training moved these logprobs far beyond the tolerance.
    assert (reference - base_reference).abs().max() > 1e-2
    ext = tc.save_weights_external("final-ext").result().path
    return {"state": state, "sampler": sampler_path, "external": ext, "reference": reference, "model_id": tc.model_id}


@pytest.fixture
def env(monkeypatch):
    monkeypatch.setenv("TINKER_API_KEY", API_KEY)
    monkeypatch.setenv("TINKER_TELEMETRY", "0")


def test_download_refuses_sampler_weights_client_side(server, trained, env, tmp_path):
    with pytest.raises(WeightsDownloadError, match="Sampler checkpoints cannot be downloaded"):
        weights.download(tinker_path=trained["sampler"], output_dir=str(tmp_path / "s"), base_url=server.url)


def test_download_build_and_compare_with_the_sampler(server, trained, env, tmp_path):
    rest = tinker.RestClient(base_url=server.url, api_key=API_KEY)
    # A training checkpoint: exported through a new run, age-encrypted to a one-off key, decrypted.
    adapter = weights.download(tinker_path=trained["state"], output_dir=str(tmp_path / "adapter"), base_url=server.url)
    assert sorted(p.name for p in (tmp_path / "adapter").iterdir()) == FILES
    (helper,) = [r for r in rest.list_training_runs(limit=1000).result().training_runs
                 if (r.user_metadata or {}).get("created_by") == "tinker_cookbook.weights.download"]
    assert rest.list_checkpoints(helper.training_run_id).result().checkpoints == []  # export deleted
    # External weights download directly, unencrypted, and hold the same bytes.
    weights.download(tinker_path=trained["external"], output_dir=str(tmp_path / "ext"), base_url=server.url)
    for name in FILES:
        assert (tmp_path / "ext" / name).read_bytes() == (tmp_path / "adapter" / name).read_bytes()

    base_dir = str(server.data_dir / "models" / "tinkerd--tiny-qwen3")
    weights.build_lora_adapter(base_model=base_dir, adapter_path=adapter, output_path=str(tmp_path / "peft"))
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    lora = peft.PeftModel.from_pretrained(base, str(tmp_path / "peft")).eval()
    diff = (_logprobs(lora, PROMPT) - trained["reference"]).abs().max().item()
    assert diff < 1e-4, diff

    weights.build_hf_model(base_model=base_dir, adapter_path=adapter, output_path=str(tmp_path / "merged"), dtype="float32")
    merged = AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged"), dtype=torch.float32).eval()
    diff = (_logprobs(merged, PROMPT) - trained["reference"]).abs().max().item()
    assert diff < 1e-4, diff
