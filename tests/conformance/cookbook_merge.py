"""What the family conformance tests (test_families, test_hybrid, test_gpt_oss) check of an export:
the cookbook's download of `save_weights_external`'s files, and its build_hf_model merge (both
strategies) scoring a prompt as tinkerd did."""

from __future__ import annotations

import torch

from tests.serverproc import API_KEY


def download(server, tinker_path: str, out_dir, monkeypatch) -> tuple[str, dict[str, torch.Tensor]]:
    """The export at `tinker_path` through the cookbook's `weights.download`: its directory and tensors."""
    from safetensors.torch import load_file
    from tinker_cookbook import weights

    monkeypatch.setenv("TINKER_API_KEY", API_KEY)
    monkeypatch.setenv("TINKER_TELEMETRY", "0")
    adapter = weights.download(tinker_path=tinker_path, output_dir=str(out_dir), base_url=server.url)
    return adapter, load_file(out_dir / "adapter_model.safetensors")


def logprobs(model, ids: list[int]) -> list[float]:
    """An HF causal LM's logprob of each of ids[1:] after the ones before it."""
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, :-1]
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0].tolist()


def assert_merges_equal(base_dir: str, adapter: str, ids: list[int], reference: list[float], tmp_path) -> None:
    """build_hf_model with merge_strategy `shard` and `full` scores ids as tinkerd did (`reference`,
    compute_logprobs[1:]) to 1e-4."""
    from tinker_cookbook import weights
    from transformers import AutoModelForCausalLM

    for strategy in ("shard", "full"):
        out = tmp_path / f"merged-{strategy}"
        weights.build_hf_model(base_model=base_dir, adapter_path=adapter, output_path=str(out), dtype="float32",
                               merge_strategy=strategy)
        merged = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
        diff = max(abs(a - b) for a, b in zip(logprobs(merged, ids), reference))
        assert diff < 1e-4, (strategy, diff)
