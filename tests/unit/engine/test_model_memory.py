"""A CPU engine's base weights live in its own memory, not in a map of the checkpoint file
(engine/model/registry.py: own_memory): a file rewritten or truncated on disk under a running
engine changes nothing in it."""

from __future__ import annotations

import gc
import shutil

import torch

from tinkerd.engine.model import registry

TINY = "tinkerd/tiny-qwen3"


def _mapped(path) -> bool:
    with open("/proc/self/maps") as maps:
        return any(line.rstrip().endswith(str(path)) for line in maps)


def test_the_weights_outlive_their_file(models_dir, tmp_path):
    src = registry.load_model(TINY, models_dir)  # built once into the shared models dir
    local = tmp_path / "tiny"
    shutil.copytree(src.tokenizer_dir, local)
    del src
    files = sorted(local.glob("*.safetensors"))
    assert files, "the tiny model is saved as safetensors"

    loaded = registry.load_model(str(local), tmp_path / "models")
    gc.collect()
    assert not any(_mapped(f.resolve()) for f in files), "a weight is still a view of the checkpoint's memory map"
    tokens = torch.tensor([[1, 5, 9, 14, 3, 7]])
    with torch.no_grad():
        before = loaded.model(tokens).logits

    for f in files:  # what `cp other.safetensors model.safetensors` does to the old inode: rewrites it in place
        size = f.stat().st_size
        with open(f, "r+b") as out:
            out.write(b"\0" * size)
    with torch.no_grad():
        after = loaded.model(tokens).logits
    assert torch.equal(before, after)
    for f in files:  # and truncated: a mapped page past the end would be SIGBUS
        f.write_bytes(b"")
    with torch.no_grad():
        assert torch.equal(loaded.model(tokens).logits, before)


def test_a_tied_head_stays_its_embedding(models_dir, tmp_path):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(registry.load_model("tinkerd/tiny-llama", models_dir).tokenizer_dir)
    config.tie_word_embeddings = True
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "tied")  # saves the embedding once

    lm = registry.load_model(str(tmp_path / "tied"), tmp_path / "models").model
    assert lm.get_output_embeddings().weight is lm.get_input_embeddings().weight  # one Parameter, copied once
