"""Family detection from saved configs (engine/model/families.py) and what a refused model does to
an Engine: it is left out with its reason, the others load."""

from __future__ import annotations

import json

import pytest

from tinkerd.engine.engine import Engine
from tinkerd.engine.model import families, tiny
from tinkerd.errors import UserError


def _saved(tmp_path, name: str) -> dict:
    tiny.build_tiny(name, tmp_path)
    return json.loads((tmp_path / "config.json").read_text())


def test_qwen3_moe_is_detected_from_the_key_transformers_saves(tmp_path):
    cfg = _saved(tmp_path, "tinkerd/tiny-qwen3-moe")
    # Built with Qwen3MoeConfig(num_experts=4), saved as num_local_experts (transformers 5.24).
    assert cfg.get("num_local_experts") == 4 and cfg.get("num_experts") is None
    assert families.detect(cfg, "m") is families.QWEN3_MOE


def test_gpt_oss_is_served_with_its_sliding_layers(tmp_path):
    cfg = _saved(tmp_path, "tinkerd/tiny-gpt-oss")
    assert cfg["layer_types"] == ["sliding_attention", "full_attention"] and cfg["num_local_experts"] == 4
    assert families.detect(cfg, "m") is families.GPT_OSS and families.GPT_OSS.experts_class == "GptOssExperts"
    # Its tokenizer is Qwen3's with the Harmony tokens the cookbook's gpt_oss renderers need as one token each.
    assert cfg["vocab_size"] == 151_669 + len(tiny.HARMONY_TOKENS) and cfg["eos_token_id"] == [151_674, 151_675]


def test_dense_families_are_served():
    for model_type in ("llama", "qwen3", "qwen2", "mistral"):
        assert families.detect({"model_type": model_type}, "m") is families.DENSE


@pytest.mark.parametrize("cfg, reason", [
    ({"model_type": "qwen3_vl_moe", "architectures": ["Qwen3VLMoeForConditionalGeneration"]}, "vision-language"),
    ({"model_type": "llava", "vision_config": {}}, "vision-language"),
    ({"model_type": "qwen3_next"}, "linear attention"),
    ({"model_type": "deepseek_v3"}, "DeepSeek-V3"),
    ({"model_type": "qwen3", "layer_types": ["full_attention", "sliding_attention"]}, "full attention"),
    ({"model_type": "mixtral", "num_local_experts": 8}, "not a family"),
    ({"model_type": "llama", "num_local_experts": 8}, "routed experts"),
])
def test_unservable_configs_are_refused_by_name_with_the_reason(cfg, reason):
    with pytest.raises(families.UnservableModel, match=reason) as e:
        families.detect(cfg, "org/some-model")
    assert "org/some-model" in e.value.message and e.value.category == "user"


def test_an_engine_serves_the_others_and_keeps_the_reason(models_dir):
    engine = Engine(models_dir)
    engine.load_base_models(["tinkerd/tiny-qwen3-vl-moe", "tinkerd/tiny-qwen3"])
    assert list(engine.runtimes) == ["tinkerd/tiny-qwen3"]
    assert "vision-language" in engine.refused["tinkerd/tiny-qwen3-vl-moe"]
    with pytest.raises(UserError, match="vision-language"):
        Engine(models_dir).load_base_models(["tinkerd/tiny-qwen3-vl-moe"])  # nothing to serve: the start fails


def test_qwen3_vl_is_served_with_its_vision_tower(tmp_path):
    cfg = _saved(tmp_path, "tinkerd/tiny-qwen3-vl")
    assert families.detect(cfg, "m") is families.QWEN3_VL and families.QWEN3_VL.vision
    # Its image processor's configuration is written beside it, as the released checkpoints have it.
    pre = json.loads((tmp_path / "preprocessor_config.json").read_text())
    assert (pre["patch_size"], pre["merge_size"], pre["size"]) == (16, 2, {"shortest_edge": 65536, "longest_edge": 16777216})


def test_qwen3_5_is_served_as_hybrid_and_its_vlm_text_only(tmp_path):
    cfg = _saved(tmp_path, "tinkerd/tiny-qwen3.5")
    assert cfg["model_type"] == "qwen3_5_text" and "linear_attention" in cfg["layer_types"]
    assert families.detect(cfg, "m") is families.QWEN3_5
    # The vision-language checkpoint (model_type qwen3_5, a vision_config) is served through its
    # language model alone; the registry logs that its tower is not loaded.
    family = families.detect({"model_type": "qwen3_5", "vision_config": {"depth": 1}, "text_config": cfg}, "m")
    assert family.text_only and "linear_attention" in family.layer_types
    # With its image processor's preprocessor_config.json it is served with the tower (images in).
    vl = _saved(tmp_path / "vl", "tinkerd/tiny-qwen3.5-vl")
    assert vl["model_type"] == "qwen3_5" and (tmp_path / "vl" / "preprocessor_config.json").is_file()
    assert families.detect(vl, "m", has_processor=True) is families.QWEN3_5_VL
    assert families.detect(vl, "m").text_only


def test_qwen3_5_moe_is_served_as_hybrid_moe(tmp_path):
    cfg = _saved(tmp_path, "tinkerd/tiny-qwen3.5-moe")
    assert cfg["model_type"] == "qwen3_5_moe_text"
    assert families.detect(cfg, "m") is families.QWEN3_5_MOE
    vl = {"model_type": "qwen3_5_moe", "vision_config": {}, "text_config": cfg}
    assert families.detect(vl, "m").text_only
    # With its preprocessor_config.json, the VLM checkpoint is served with its tower (images in).
    assert families.detect(vl, "m", has_processor=True) is families.QWEN3_5_MOE_VL


def test_a_moe_without_its_experts_module_is_refused_not_served_without_expert_lora(models_dir, monkeypatch):
    """A quantized gpt-oss checkpoint can load with its experts swapped for another class (transformers'
    Mxfp4GptOssExperts); served, train_mlp would put LoRA on no expert without a word."""
    import dataclasses

    from tinkerd.engine import engine as engine_mod

    real = engine_mod.load_model

    def load(name, *args):
        loaded = real(name, *args)
        if name == "tinkerd/tiny-gpt-oss":
            loaded.family = dataclasses.replace(loaded.family, experts_class="Mxfp4GptOssExperts")
        return loaded

    monkeypatch.setattr(engine_mod, "load_model", load)
    engine = Engine(models_dir)
    engine.load_base_models(["tinkerd/tiny-gpt-oss", "tinkerd/tiny-qwen3"])
    assert list(engine.runtimes) == ["tinkerd/tiny-qwen3"]
    assert "no Mxfp4GptOssExperts module" in engine.refused["tinkerd/tiny-gpt-oss"]
