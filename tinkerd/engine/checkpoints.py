"""Adapter checkpoint files: a PEFT adapter directory, plus optimizer state for training checkpoints.

Layout of one checkpoint directory:

    adapter_model.safetensors  base_model.model.<hf module>.lora_A.weight [R, in]
                               base_model.model.<hf module>.lora_B.weight [out, R]
                               MoE experts in hosted Tinker's layout (lora/experts.py:
                               to_file_layout): <experts>.w1|w3|w2, A [E, R, in], B [E, out, R]
                               Qwen3.5's fused DeltaNet in_proj_qkv as in_proj_q/k/v sharing A
                               (lora/deltanet.py), as hosted Tinker stores it
    adapter_config.json        what `peft.PeftModel.from_pretrained` reads (exports need nothing else)
    tinkerd.json               LoRA spec, step, base model (exact spec, incl. seed and train_* flags)
    optimizer.pt               only when with_optimizer: torch.save of an AdamW state_dict whose
                               parameter indices follow `canonical_params` (sorted layer names,
                               A then B), so it restores into any adapter with the same layers
                               whatever order its own optimizer lists them in

Everything is written into a temporary directory next to the target and renamed into place, so a
crash leaves either the old checkpoint, the new one, or none: never a half one under the real name.
The files are serialised in memory first and written with plain writes, so that a full disk is an
OSError(ENOSPC) we can name, not torch's "[enforce fail at inline_container.cc] unexpected pos"
(a rank-32 SmolLM2 state is ~120 MB: held twice for the moment of the write). A failed write
raises ServerError naming the disk and its free space, and removes the temporary directory.
"""

from __future__ import annotations

import errno
import io
import json
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file
from safetensors.torch import save as safetensors_bytes

from tinkerd.engine.lora import deltanet, experts
from tinkerd.engine.lora.layers import ATTN_TARGETS, MLP_TARGETS, UNEMBED_TARGET
from tinkerd.engine.lora.pool import Adapter
from tinkerd.errors import NotFoundError, ServerError, UserError
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
    optimizer = torch.optim.AdamW(canonical_params(adapter), lr=1e-4, foreach=True)
    if state is not None:
        try:
            optimizer.load_state_dict(state)
        except (ValueError, KeyError) as e:
            raise UserError(f"checkpoint optimizer state does not fit this adapter: {e}") from e
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


def lora_tensors(adapter: Adapter) -> dict[str, torch.Tensor]:
    """The adapter's A and B under PEFT key names, fp32 copies (the live tensors keep training)."""
    tensors = {}
    for name in sorted(adapter.weights):
        for file_name, a, b in _file_layout(name, adapter):
            tensors[f"{_KEY_PREFIX}{file_name}{_A_SUFFIX}"] = a.detach().float().contiguous().clone()
            tensors[f"{_KEY_PREFIX}{file_name}{_B_SUFFIX}"] = b.detach().float().contiguous().clone()
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
    """Write `adapter` to `dir_path` (replacing what is there); returns the bytes written."""
    target = Path(dir_path)
    target.parent.mkdir(parents=True, exist_ok=True)
    if with_optimizer and adapter.optimizer is None:
        raise UserError(f"model {adapter.key!r} has no optimizer state to save")
    names = sorted(adapter.weights)
    meta = {
        "format_version": FORMAT_VERSION,
        "base_model": base_model,
        "lora": _spec_to_json(adapter.spec),
        "step": adapter.step,
        "with_optimizer": with_optimizer,
    }
    files = {
        WEIGHTS_FILE: safetensors_bytes(lora_tensors(adapter), metadata={"format": "pt"}),
        CONFIG_FILE: json.dumps(peft_config(adapter.spec, names, base_model), indent=2).encode(),
        META_FILE: json.dumps(meta, indent=2).encode(),
    }
    if with_optimizer:
        buf = io.BytesIO()
        torch.save(_canonical_optimizer_state(adapter), buf)
        files[OPTIMIZER_FILE] = buf.getvalue()
    return write_files_atomically(target, files)


def write_files_atomically(target: Path, files: dict[str, bytes]) -> int:
    """Write `files` (name -> content) as the directory `target`, replacing what is there, with the
    same temp-then-rename guarantee as save_adapter; returns the bytes written. A failed write
    (ENOSPC, EIO) raises ServerError and leaves `target` as it was."""
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    except OSError as e:
        raise _write_error(target, e) from e
    try:
        for name, data in files.items():
            with open(tmp / name, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
        _swap_into_place(tmp, target)
    except OSError as e:
        raise _write_error(target, e) from e
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return sum(len(d) for d in files.values())


def _write_error(target: Path, e: OSError) -> ServerError:
    """A server error (not the caller's fault) that names the disk: the SDK does not retry a failed
    future, so the user reads this once and can tell the operator what to free."""
    where = target.parent
    while not where.exists() and where != where.parent:
        where = where.parent
    try:
        st = os.statvfs(where)
        space = f"{_human(st.f_bavail * st.f_frsize)} free of {_human(st.f_blocks * st.f_frsize)} on {where}"
    except OSError:
        space = f"free space on {where} unknown"
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        return ServerError(f"cannot write checkpoint {target.name!r}: the server's disk is full ({e.strerror}: {space}); "
                           f"nothing was saved, save it again once space is freed")
    return ServerError(f"cannot write checkpoint {target.name!r}: {e.strerror or e} ({space}); nothing was saved")


def _human(n: int) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} bytes"


def _swap_into_place(tmp: Path, target: Path) -> None:
    # os.replace cannot replace a non-empty directory, so an existing checkpoint is first renamed
    # aside (also atomic) and deleted only after the new one is in place.
    old = None
    if target.exists():
        old = Path(tempfile.mkdtemp(prefix=f".{target.name}.old-", dir=target.parent))
        os.replace(target, old / "ckpt")
    os.replace(tmp, target)
    dir_fd = os.open(target.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


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
    """Read a checkpoint written by save_adapter (or a plain PEFT LoRA adapter directory)."""
    path = Path(dir_path)
    if not (path / WEIGHTS_FILE).is_file() or not (path / CONFIG_FILE).is_file():
        raise NotFoundError(f"no adapter checkpoint at {str(path)!r}")
    try:
        peft_cfg = json.loads((path / CONFIG_FILE).read_text())
        meta = json.loads((path / META_FILE).read_text()) if (path / META_FILE).is_file() else None
        tensors = load_file(path / WEIGHTS_FILE)
    except (OSError, ValueError, SafetensorError) as e:
        raise UserError(f"unreadable adapter checkpoint at {str(path)!r}: {e}") from e
    if meta is not None:
        spec = LoraSpec(**meta["lora"])
        base_model, step = meta["base_model"], int(meta["step"])
    else:
        spec = _spec_from_peft_config(peft_cfg)
        base_model, step = peft_cfg.get("base_model_name_or_path") or "", 0
    optimizer_state = None
    if (path / OPTIMIZER_FILE).is_file():
        optimizer_state = torch.load(path / OPTIMIZER_FILE, map_location="cpu", weights_only=True)
    return AdapterFiles(
        spec=spec,
        weights=_split_weights(tensors, spec.rank),
        optimizer_state=optimizer_state,
        step=step,
        base_model=base_model,
    )
