"""Which model families tinkerd serves, detected from a checkpoint's saved `config.json`.

The decision is made on the config dict as transformers writes it (`save_pretrained`), before any
weights are read, so that a base model tinkerd cannot serve is refused by name with its reason
instead of failing deep in a load (a Qwen3-VL config makes `AutoModelForCausalLM` raise
"Unrecognized configuration class") or, worse, loading as something else (`AutoModelForCausalLM`
takes a Qwen3.5 VLM config and silently drops its vision tower).

Saved keys differ from constructor keywords: `Qwen3MoeConfig(num_experts=4)` is written as
`num_local_experts` (transformers 5.24), so MoE is detected from either key.

| family     | model_type                       | LoRA on                                        |
|------------|----------------------------------|------------------------------------------------|
| dense      | llama, mistral, qwen2, qwen3     | attention, MLP, lm_head                        |
| qwen3_moe  | qwen3_moe                        | attention, every routed expert (lora/experts.py), dense MLP layers, lm_head |
| qwen3_5    | qwen3_5_text; qwen3_5 text only  | Gated DeltaNet in_proj_qkv/in_proj_z/out_proj, gated attention q/k/v/o, MLP, lm_head |
| qwen3_5_moe | qwen3_5_moe_text; qwen3_5_moe text only | as qwen3_5, with every routed expert and the shared expert instead of the MLP |
| gpt_oss    | gpt_oss                          | attention q/k/v/o, every routed expert (interleaved gate/up, lora/experts.py), lm_head |
| qwen3_vl   | qwen3_vl (with its vision tower) | the language model's attention, MLP, lm_head; none on the tower |
| qwen3_5 VL | qwen3_5 with preprocessor_config.json | as qwen3_5; none on the tower |
| qwen3_5_moe VL | qwen3_5_moe with preprocessor_config.json | as qwen3_5_moe; none on the tower |

Qwen3.5 is hybrid linear attention: 3 of every 4 layers are Gated DeltaNet (conv + recurrent
state, no KV cache; the sampler keeps both, sampler/hybrid.py). A `qwen3_5` checkpoint (the
vision-language one, with `vision_config`) is served with its vision tower when its
`preprocessor_config.json` is there (images in, engine/model/vision.py), and so is a `qwen3_5_moe`
one; without it `AutoModelForCausalLM` loads the language model alone and the registry logs as a warning, naming the model, that the tower is not loaded and images are refused.

gpt-oss alternates sliding-window and full attention layers (`layer_types`); its attention adds a
learned per-head sink logit to the softmax (transformers' eager attention, which the model is
loaded with), and the sampler gives its sliding layers their own window mask (sampler/sample.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from tinkerd.errors import UnservableModel


@dataclass(frozen=True)
class Family:
    name: str
    # The fused-experts module class (transformers 5.x, 3-D gate_up_proj/down_proj) whose instances
    # get tinkerd's multi-adapter experts layer; None for dense families.
    experts_class: str | None = None
    # Layer types besides full attention that the family's modules and the sampler handle.
    layer_types: frozenset[str] = frozenset({"full_attention"})
    # A vision-language checkpoint served through its language model only (its tower is not loaded).
    text_only: bool = False
    # A vision-language model served with its tower: loaded as image-text-to-text, takes ImageChunks
    # (engine/model/vision.py).
    vision: bool = False


DENSE = Family("dense")
QWEN3_MOE = Family("qwen3_moe", experts_class="Qwen3MoeExperts")
_HYBRID = frozenset({"full_attention", "linear_attention"})
QWEN3_VL = Family("qwen3_vl", vision=True)
QWEN3_5 = Family("qwen3_5", layer_types=_HYBRID)
QWEN3_5_TEXT_ONLY = Family("qwen3_5", layer_types=_HYBRID, text_only=True)
QWEN3_5_VL = Family("qwen3_5", layer_types=_HYBRID, vision=True)
QWEN3_5_MOE = Family("qwen3_5_moe", experts_class="Qwen3_5MoeExperts", layer_types=_HYBRID)
QWEN3_5_MOE_TEXT_ONLY = Family("qwen3_5_moe", experts_class="Qwen3_5MoeExperts", layer_types=_HYBRID, text_only=True)
GPT_OSS = Family("gpt_oss", experts_class="GptOssExperts", layer_types=frozenset({"full_attention", "sliding_attention"}))
QWEN3_5_MOE_VL = Family("qwen3_5_moe", experts_class="Qwen3_5MoeExperts", layer_types=_HYBRID, vision=True)

_SERVED = {"llama": DENSE, "mistral": DENSE, "qwen2": DENSE, "qwen3": DENSE, "qwen3_moe": QWEN3_MOE,
           "qwen3_5_text": QWEN3_5, "qwen3_5_moe_text": QWEN3_5_MOE, "qwen3_vl": QWEN3_VL, "gpt_oss": GPT_OSS}
# Vision-language checkpoints served as their language model alone (see the module docstring).
_TEXT_ONLY = {"qwen3_5": QWEN3_5_TEXT_ONLY, "qwen3_5_moe": QWEN3_5_MOE_TEXT_ONLY}
# ... and the same served with the tower, when the checkpoint has its image processor's
# preprocessor_config.json (the image token count depends on it).
_WITH_TOWER = {"qwen3_5": QWEN3_5_VL, "qwen3_5_moe": QWEN3_5_MOE_VL}

# Known but not (yet) served, with the reason a user reads.
_VISION = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl_moe", "kimi_k25",
           "llava", "mllama", "gemma3", "idefics3", "inkling")
_NOT_YET = {
    "qwen3_next": "hybrid linear attention (Gated DeltaNet) is not served yet",
    "deepseek_v3": "DeepSeek-V3 MoE is not served yet",
}


def _experts(config: dict) -> int:
    for key in ("num_local_experts", "num_experts", "n_routed_experts"):
        value = config.get(key)
        if isinstance(value, int) and value > 0:
            return value
    return 0


def detect(config: dict, name: str, has_processor: bool = False) -> Family:
    """The family of the model whose saved config is `config`, or UnservableModel naming why not.
    `has_processor`: its preprocessor_config.json is there (a Qwen3.5 VLM is then served with its
    vision tower, else text only)."""
    model_type = config.get("model_type") or "?"
    arch = ",".join(config.get("architectures") or []) or model_type

    def refuse(reason: str) -> UnservableModel:
        served = ", ".join(sorted(_SERVED))
        return UnservableModel(f"base model {name!r} ({arch}, model_type {model_type!r}) cannot be served: {reason} "
                               f"(served model types: {served})")

    if model_type in _TEXT_ONLY:
        family = _WITH_TOWER.get(model_type, _TEXT_ONLY[model_type]) if has_processor else _TEXT_ONLY[model_type]
    elif model_type in _SERVED and _SERVED[model_type].vision:
        family = _SERVED[model_type]
    elif model_type in _VISION or "vision_config" in config:
        raise refuse("it is a vision-language model; tinkerd serves text-only models")
    elif model_type in _NOT_YET:
        raise refuse(_NOT_YET[model_type])
    else:
        family = _SERVED.get(model_type)
    if family is None:
        raise refuse("this model type is not a family tinkerd serves")
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    if any(t not in family.layer_types for t in (text.get("layer_types") or [])):
        raise refuse(f"its layer types {sorted(set(text['layer_types']))} are not all {' or '.join(sorted(t.replace('_', ' ') for t in family.layer_types))}")
    if family.experts_class is None and _experts(config):
        raise refuse("it has routed experts, which tinkerd serves only for the MoE families")
    return family
