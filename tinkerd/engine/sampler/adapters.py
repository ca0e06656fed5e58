"""What a sampler serves a request with: the model split into decoder body and head, and the
adapter a request names, loaded from the artifact store and held in the runtime's pool."""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

from tinkerd.engine.sampler.hybrid import LINEAR
from tinkerd.engine.sampler.kv import SLIDING, sliding_window
from tinkerd.errors import NotFoundError, ServerError

if TYPE_CHECKING:
    from tinkerd.engine.engine import ModelRuntime
    from tinkerd.engine.lora.pool import Adapter


def split_model(model: nn.Module) -> tuple[nn.Module, nn.Module]:
    """The decoder body and the (multi-LoRA) lm_head of a causal LM.

    Logits are computed as head(body(x)), which is what the HF forward does for Qwen3 / Llama.
    Models that post-process logits (Gemma 2's soft-capping) would silently sample from the wrong
    distribution, so it is refused instead. Linear-attention layers (Qwen3.5's Gated DeltaNet) keep
    their states in the hybrid batch cache (hybrid.py); sliding-window layers (gpt-oss) get their
    window as a mask of their own (kv.window_masks).
    """
    if getattr(model.config, "final_logit_softcapping", None):
        raise ServerError(f"{type(model).__name__} soft-caps its logits; the sampler does not support that")
    layer_types = getattr(model.config.get_text_config(), "layer_types", None) or ()
    if any(t not in ("full_attention", LINEAR, SLIDING) for t in layer_types):
        raise ServerError(f"{type(model).__name__} has {set(layer_types)} layers; the sampler supports full, sliding-window and linear attention only")
    if SLIDING in layer_types and not sliding_window(model.config.get_text_config()):
        raise ServerError(f"{type(model).__name__} has sliding-window layers but no sliding_window")
    return model.get_decoder(), model.get_output_embeddings()


def acquire_adapter(runtime: ModelRuntime, adapter_path: str | None, max_idle: int) -> Adapter | None:
    """The pool entry serving `adapter_path`, held for one request (None: the base model).

    `adapter_path` is a key of the runtime's ArtifactStore (tinkerd/artifacts.py). Loaded once per
    key and reused while the artifact stands: its store version is remembered, so a checkpoint
    re-saved under the same key is reloaded, while requests already decoding keep the old weights.
    Loading evicts idle sampler adapters beyond `max_idle`, least recently used first.
    """
    if adapter_path is None:
        return None
    fingerprint = runtime.artifacts.version(adapter_path)
    if fingerprint is None:
        raise NotFoundError(f"no sampler weights at {adapter_path!r}")
    pool = runtime.pool
    if adapter_path in pool:
        if pool.get(adapter_path).extra.get("fingerprint") == fingerprint:
            return pool.acquire(adapter_path)
        pool.retire(adapter_path)
    files = _read_adapter(runtime.artifacts, adapter_path, runtime.pool.layers)
    pool.evict_idle(keep=max(0, max_idle - 1))
    adapter = pool.create_from_tensors(adapter_path, files.spec, files.weights, trainable=False)
    adapter.extra["fingerprint"] = fingerprint
    return pool.acquire(adapter_path)


def _read_adapter(store, key: str, layers):
    # Imported here, not at the top: checkpoints.py brings in the PEFT file format, which only
    # requests naming a sampler checkpoint need.
    from tinkerd.engine import checkpoints

    files = checkpoints.read_adapter_from(store, key)
    files.weights = checkpoints.onto_layers(files.weights, layers)
    return files
