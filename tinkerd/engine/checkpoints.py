"""Adapter checkpoint files: a PEFT adapter directory, plus optimizer state for training checkpoints.

Layout of one checkpoint directory:

    adapter_model.safetensors  base_model.model.<hf module>.lora_A.weight [R, in]
                               base_model.model.<hf module>.lora_B.weight [out, R]
                               MoE experts in hosted Tinker's layout (lora/experts.py:
                               to_file_layout): <experts>.w1|w3|w2, A [E, R, in], B [E, out, R]
                               Qwen3.5's fused DeltaNet in_proj_qkv as in_proj_q/k/v sharing A
                               (lora/deltanet.py), as hosted Tinker stores it
                               a vision-language model's language model without the
                               `language_model` segment (hosted_name), as hosted Tinker keys it
    adapter_config.json        what `peft.PeftModel.from_pretrained` reads (exports need nothing else)
    tinkerd.json               LoRA spec, step, base model (exact spec, incl. seed and train_* flags)
    optimizer.pt               only when with_optimizer: torch.save of an AdamW state_dict whose
                               parameter indices follow `canonical_params` (sorted layer names,
                               A then B), so it restores into any adapter with the same layers
                               whatever order its own optimizer lists them in

A checkpoint is an artifact of the ArtifactStore (tinkerd/artifacts.py): ops name it by key and
the engine writes and reads it through its store, which makes it visible whole or not at all (the
local store: a temp dir renamed into place). The files are serialised in memory first and written
with plain writes, so that a full disk is an OSError(ENOSPC) the store can name, not torch's
"[enforce fail at inline_container.cc] unexpected pos" (a rank-32 SmolLM2 state is ~120 MB: held
twice for the moment of the write). A failed write raises ServerError naming the disk and its free
space. `save_adapter`/`read_adapter` take a directory instead (tests, tools): a local store around it.
"""

from __future__ import annotations

import io
import json
import logging
import os
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as safetensors_bytes

from tinkerd.artifacts import ArtifactStore, LocalArtifactStore
from tinkerd.engine import adam
from tinkerd.engine.lora import deltanet, experts
from tinkerd.engine.lora.layers import ATTN_TARGETS, MLP_TARGETS, UNEMBED_TARGET
from tinkerd.engine.lora.pool import Adapter
from tinkerd.errors import NotFoundError, UserError
from tinkerd.types import LoraSpec

WEIGHTS_FILE = "adapter_model.safetensors"
CONFIG_FILE = "adapter_config.json"
META_FILE = "tinkerd.json"
OPTIMIZER_FILE = "optimizer.pt"
FORMAT_VERSION = 1

log = logging.getLogger(__name__)

# PEFT wraps the HF model twice (PeftModel -> LoraModel -> model), hence this prefix on every key.
_KEY_PREFIX = "base_model.model."
_A_SUFFIX = ".lora_A.weight"
_B_SUFFIX = ".lora_B.weight"
# PEFT also saves a full copy of a targeted lm_head/embedding (`save_embedding_layers`, on by default
# when lm_head is a target) in case the vocabulary was resized; tinkerd serves the base's own layer.
_BASE_LAYER_SUFFIX = ".base_layer.weight"
# Where a vision-language model (Qwen3-VL, Qwen3.5) keeps its language model's modules.
_VLM_SEGMENT = "model.language_model."


@dataclass
class AdapterFiles:
    spec: LoraSpec
    # HF module name -> (A [R, in], B [out, R]) fp32, in sorted name order.
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]]
    # AdamW state_dict in canonical parameter order; None for sampler/exported checkpoints.
    optimizer_state: dict | None
    step: int
    base_model: str


def canonical_params(adapter: Adapter) -> list[torch.Tensor]:
    """The adapter's tensors in file order: sorted layer names, A then B."""
    return [t for name in sorted(adapter.weights) for t in adapter.weights[name]]


def new_optimizer(adapter: Adapter, state: dict | None = None) -> torch.optim.Optimizer:
    """A fresh AdamW over the adapter's tensors, with `state` (canonical order) restored when given.

    Hyperparameters here are placeholders: optim_step sets lr/betas/eps/weight_decay every step.
    """
    optimizer = adam.new_adamw(canonical_params(adapter))
    if state is not None:
        fresh = dict(optimizer.param_groups[0])
        try:
            optimizer.load_state_dict(state)
        except (ValueError, KeyError) as e:
            raise UserError(f"checkpoint optimizer state does not fit this adapter: {e}") from e
        adam.keep_kernel(optimizer, fresh)
    return optimizer


def _canonical_optimizer_state(adapter: Adapter) -> dict:
    """The adapter optimizer's state_dict re-indexed to canonical_params order."""
    optimizer = adapter.optimizer
    assert optimizer is not None and len(optimizer.param_groups) == 1
    own_index = {id(p): i for i, p in enumerate(optimizer.param_groups[0]["params"])}
    to_canonical = {own_index[id(p)]: j for j, p in enumerate(canonical_params(adapter))}
    sd = optimizer.state_dict()
    return {
        "state": {to_canonical[i]: s for i, s in sd["state"].items()},
        "param_groups": [{**g, "params": sorted(to_canonical[i] for i in g["params"])} for g in sd["param_groups"]],
    }


def _file_layout(name: str, adapter: Adapter) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """One adapter layer as stored: experts in hosted Tinker's w1/w3/w2, a DeltaNet in_proj_qkv as
    in_proj_q/k/v (lora/deltanet.py), anything else as is."""
    a, b = adapter.weights[name]
    if name in adapter.splits:
        return deltanet.to_file_layout(name, a, b, adapter.splits[name])
    return experts.to_file_layout(name, a, b)


def hosted_name(name: str) -> str:
    """A module name as hosted Tinker keys it: a VLM's `model.language_model.X` is `model.X`.

    The cookbook's `weights` merge and adapter conversion add the segment back when the base's own
    keys have it (`build_name_remaps`: "model." -> "model.language_model."), so a key that kept it
    would become `model.language_model.language_model.X` there and match nothing."""
    return "model." + name[len(_VLM_SEGMENT):] if name.startswith(_VLM_SEGMENT) else name


def onto_layers(weights: dict[str, tuple[torch.Tensor, torch.Tensor]],
                layers) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """A checkpoint's layers under the module names of the model that loads it (`layers`).

    Hosted names (`model.X`) go to the VLM's `model.language_model.X`. Other names stay as they
    are: a text model's (hosted and module names are one), those of checkpoints written before
    VLM exports took the hosted layout (they kept the segment: the modules' own names), and names
    the model lacks, for the caller's "layers this model lacks" error."""
    by_hosted = {hosted_name(n): n for n in layers}
    return {by_hosted.get(n, n): ab for n, ab in weights.items()}


def lora_tensors(adapter: Adapter, copy: bool = True) -> dict[str, torch.Tensor]:
    """The adapter's A and B under PEFT key names, fp32 copies (the live tensors keep training);
    copy=False: the live fp32 tensors themselves where they are already so laid out, for a caller
    that serialises them before the adapter's next step; still a copy where a tensor shares memory
    with one before it (a DeltaNet's one A stored for each of q, k and v), which safetensors refuses."""
    tensors, seen = {}, set()
    for name in sorted(adapter.weights):
        for layout_name, a, b in _file_layout(name, adapter):
            file_name = hosted_name(layout_name)
            for suffix, t in ((_A_SUFFIX, a), (_B_SUFFIX, b)):
                t = t.detach().float().contiguous()
                storage = t.untyped_storage().data_ptr()
                tensors[f"{_KEY_PREFIX}{file_name}{suffix}"] = t.clone() if copy or storage in seen else t
                seen.add(storage)
    return tensors


def peft_config(spec: LoraSpec, layer_names: list[str], base_model: str) -> dict:
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": spec.rank,
        "lora_alpha": spec.alpha,
        # Short names: PEFT matches them as suffixes, and an adapter covers every layer of a kind.
        "target_modules": sorted({f.rsplit(".", 1)[-1] for n in layer_names for e in experts.file_names(n)
                                  for f in deltanet.file_names(e)}),
        "lora_dropout": 0.0,
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
        "inference_mode": True,
    }


def _spec_to_json(spec: LoraSpec) -> dict:
    return {
        "rank": spec.rank,
        "alpha": spec.alpha,
        "seed": spec.seed,
        "train_attn": spec.train_attn,
        "train_mlp": spec.train_mlp,
        "train_unembed": spec.train_unembed,
    }


def save_adapter(adapter: Adapter, base_model: str, dir_path: str | os.PathLike, with_optimizer: bool) -> int:
    """Write `adapter` as the directory `dir_path` (replacing what is there); returns the bytes written."""
    store, key = _local(dir_path)
    return store.put(key, adapter_files(adapter, base_model, with_optimizer))


def save_adapter_to(store: ArtifactStore, key: str, adapter: Adapter, base_model: str, with_optimizer: bool) -> int:
    """Write `adapter` as the artifact `key` (replacing what is there); returns the bytes written."""
    return store.put(key, adapter_files(adapter, base_model, with_optimizer))


def adapter_files(adapter: Adapter, base_model: str, with_optimizer: bool) -> dict[str, bytes]:
    """A checkpoint's files (see the module docstring), serialised."""
    return capture(adapter, base_model, with_optimizer, copy=False).files()


@dataclass
class Captured:
    """An adapter's checkpoint as of one moment, in tensors the adapter no longer touches: the
    copy is all a write needs from the step, and the files can be serialised and written while the
    adapter trains on (engine/snapshots.py)."""

    tensors: dict[str, torch.Tensor]  # PEFT key names -> fp32 copies (lora_tensors)
    config: dict
    meta: dict
    optimizer_state: dict | None  # canonical order, its tensors copied

    def files(self, staging: Staging | None = None) -> dict[str, bytes | memoryview]:
        """The checkpoint's files. With `staging` (engine/snapshots.py), optimizer.pt is serialised
        into that reused buffer and handed out as a view of it, valid until the buffer's next use."""
        files = {
            WEIGHTS_FILE: safetensors_bytes(self.tensors, metadata={"format": "pt"}),
            CONFIG_FILE: json.dumps(self.config, indent=2).encode(),
            META_FILE: json.dumps(self.meta, indent=2).encode(),
        }
        if self.optimizer_state is not None and staging is not None:
            staging.reset()
            with _without_crc32():
                torch.save(self.optimizer_state, staging)
            files[OPTIMIZER_FILE] = staging.view()
        elif self.optimizer_state is not None:
            buf = io.BytesIO()
            torch.save(self.optimizer_state, buf)
            files[OPTIMIZER_FILE] = buf.getvalue()
        return files


@contextmanager
def _without_crc32():
    """torch.save without the zip records' CRC-32, for a recovery snapshot's optimizer.pt (staging:
    engine/snapshots.py). Its CRCs took ~40 of the ~95 ms that serialising a SmolLM2 rank-32 state
    took in the training step, and nothing checks them: torch.load does not, and a snapshot is only
    ever read back by the engine (a user's checkpoint keeps them). The setting is the process's;
    the engine's step thread is the only one that serialises."""
    from torch.utils.serialization import config

    kept = config.save.compute_crc32
    torch.serialization.set_crc32_options(False)
    try:
        yield
    finally:
        torch.serialization.set_crc32_options(kept)


class Staging:
    """A write-only file that keeps its memory: serialised in place over the last contents.

    A snapshot's optimizer.pt (~90 MB for SmolLM2 rank 32) serialised into a fresh BytesIO touched
    ~22k new pages twice (the buffer, then getvalue's copy), and on a VM that hands freed pages back
    to its host each page fault is paid again on every snapshot. It keeps the largest file written
    so far (one per SnapshotWriter)."""

    def __init__(self) -> None:
        self._buf = bytearray()
        self._pos = 0

    def reset(self) -> None:
        self._pos = 0

    def write(self, data) -> int:
        n = len(data)
        end = self._pos + n
        if end > len(self._buf):
            self._buf.extend(bytes(end - len(self._buf)))
        self._buf[self._pos:end] = data
        self._pos = end
        return n

    def flush(self) -> None:
        pass

    def view(self) -> memoryview:
        return memoryview(self._buf)[:self._pos]


def capture(adapter: Adapter, base_model: str, with_optimizer: bool, copy: bool = True) -> Captured:
    """Copy what a checkpoint of `adapter` holds now (Captured). copy=False: the live tensors, for a
    caller that serialises them before the adapter's next step (engine/snapshots.py): a snapshot
    then makes no copy of the ~120 MB state that it serialises at once anyway."""
    if with_optimizer and adapter.optimizer is None:
        raise UserError(f"model {adapter.key!r} has no optimizer state to save")
    meta = {
        "format_version": FORMAT_VERSION,
        "base_model": base_model,
        "lora": _spec_to_json(adapter.spec),
        "step": adapter.step,
        "with_optimizer": with_optimizer,
    }
    state = None
    if with_optimizer:
        # state_dict() hands out the live moments, which the next optim_step updates in place.
        state = _canonical_optimizer_state(adapter)
        if copy:
            state["state"] = {i: {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in s.items()}
                              for i, s in state["state"].items()}
    return Captured(lora_tensors(adapter, copy), peft_config(adapter.spec, sorted(adapter.weights), base_model), meta,
                    state)


def _local(dir_path: str | os.PathLike) -> tuple[LocalArtifactStore, str]:
    path = Path(dir_path).absolute()
    return LocalArtifactStore(path.parent), path.name


def _spec_from_peft_config(cfg: dict) -> LoraSpec:
    """For directories without tinkerd.json (e.g. adapters trained elsewhere)."""
    if cfg.get("peft_type", "LORA") != "LORA":
        raise UserError(f"checkpoint is a {cfg.get('peft_type')} adapter; only LoRA is supported")
    if cfg.get("rank_pattern") or cfg.get("alpha_pattern") or cfg.get("use_dora"):
        raise UserError("checkpoint uses per-layer ranks/alphas or DoRA, which tinkerd does not support")
    targets = cfg.get("target_modules") or []
    targets = {targets} if isinstance(targets, str) else {t.rsplit(".", 1)[-1] for t in targets}
    return LoraSpec(
        rank=int(cfg["r"]),
        alpha=float(cfg.get("lora_alpha", cfg["r"])),
        train_attn=bool(targets & {*ATTN_TARGETS, *deltanet.PARTS}),
        train_mlp=bool(targets & {*MLP_TARGETS, "gate_up_proj", "w1", "w2", "w3"}),
        train_unembed=UNEMBED_TARGET in targets,
    )


def _split_weights(tensors: dict[str, torch.Tensor], rank: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    halves: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        if key.endswith(_BASE_LAYER_SUFFIX):
            log.warning("ignoring %s: a copy of a base-model layer, not LoRA weights", key)
            continue
        if not key.startswith(_KEY_PREFIX) or not key.endswith((_A_SUFFIX, _B_SUFFIX)):
            raise UserError(f"unexpected tensor {key!r} in {WEIGHTS_FILE}")
        which = "a" if key.endswith(_A_SUFFIX) else "b"
        name = key[len(_KEY_PREFIX) : -len(_A_SUFFIX)]
        halves.setdefault(name, {})[which] = t.float()
    weights = {}
    for name in sorted(halves):
        pair = halves[name]
        if set(pair) != {"a", "b"}:
            raise UserError(f"checkpoint has only one of lora_A/lora_B for {name}")
        a, b = pair["a"], pair["b"]
        # 2-D for a Linear; 3-D [E, R, in] / [E, out, R] for MoE experts (lora/experts.py)
        if a.dim() != b.dim() or a.dim() not in (2, 3) or a.shape[-2] != rank or b.shape[-1] != rank:
            shapes = f"({tuple(a.shape)}, {tuple(b.shape)})"
            raise UserError(f"checkpoint LoRA shapes for {name} {shapes} do not match rank {rank}")
        weights[name] = (a, b)
    if not weights:
        raise UserError(f"{WEIGHTS_FILE} holds no LoRA weights")
    try:
        return dict(sorted(deltanet.from_file_layout(experts.from_file_layout(weights)).items()))
    except ValueError as e:
        raise UserError(f"checkpoint LoRA cannot be loaded: {e}") from e


def read_adapter(dir_path: str | os.PathLike) -> AdapterFiles:
    """Read a checkpoint directory written by save_adapter (or a plain PEFT LoRA adapter directory)."""
    store, key = _local(dir_path)
    return read_adapter_from(store, key, shown=str(dir_path))


def read_adapter_from(store: ArtifactStore, key: str, shown: str | None = None) -> AdapterFiles:
    """Read the checkpoint artifact `key` (save_adapter_to's, or a plain PEFT LoRA adapter's files)."""
    shown = shown or key
    try:
        names = set(store.names(key))
    except NotFoundError:
        names = set()
    if WEIGHTS_FILE not in names or CONFIG_FILE not in names:
        raise NotFoundError(f"no adapter checkpoint at {shown!r}")
    try:
        peft_cfg = json.loads(store.read(key, CONFIG_FILE))
        meta = json.loads(store.read(key, META_FILE)) if META_FILE in names else None
        tensors = load_safetensors(store.read(key, WEIGHTS_FILE))
    except (OSError, ValueError, SafetensorError, NotFoundError) as e:
        raise UserError(f"unreadable adapter checkpoint at {shown!r}: {e}") from e
    if meta is not None:
        spec = LoraSpec(**meta["lora"])
        base_model, step = meta["base_model"], int(meta["step"])
    else:
        spec = _spec_from_peft_config(peft_cfg)
        base_model, step = peft_cfg.get("base_model_name_or_path") or "", 0
    optimizer_state = None
    if OPTIMIZER_FILE in names:
        optimizer_state = torch.load(io.BytesIO(store.read(key, OPTIMIZER_FILE)), map_location="cpu", weights_only=True)
    return AdapterFiles(
        spec=spec,
        weights=_split_weights(tensors, spec.rank),
        optimizer_state=optimizer_state,
        step=step,
        base_model=base_model,
    )
