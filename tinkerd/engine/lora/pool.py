"""The adapter pool: maps tenant-facing ids (model_id, sampler path) to slots and owns their state.

Only the pool knows slots. Each adapter owns its LoRA tensors, its AdamW state and its step count;
attaching it registers its tensors with the MultiLoraLinear layers it targets.

Sampler adapters (non-trainable, loaded from a checkpoint path) are a cache: an RL loop makes a
new ephemeral sampler every step, so without a bound they pile up forever (a rank-32 adapter on
SmolLM2-135M, all linears and the LM head, is 45 MB in fp32). `evict_idle` drops the least
recently used ones that no in-flight request holds (`acquire`/`release` count the holders);
training adapters are never evicted here. Both kinds are also released when their session stops
heart-beating (control/residency.py): a training adapter only after its state is snapshotted.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field

import torch

from tinkerd.engine.adam import new_adamw
from tinkerd.engine.lora.experts import ExpertsParam
from tinkerd.engine.lora.layers import MultiLoraLinear, LoraWeights, targets_for
from tinkerd.errors import NotFoundError, UserError
from tinkerd.types import LoraSpec


@dataclass
class Adapter:
    key: str
    slot: int
    spec: LoraSpec
    # HF module name -> (A [R, in], B [out, R]); leaf tensors with requires_grad when trainable.
    # Fused MoE experts (lora/experts.py): `<experts module>.gate_up_proj|down_proj` -> A [E, R, in],
    # B [E, out, R].
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]]
    trainable: bool
    optimizer: torch.optim.Optimizer | None = None
    step: int = 0
    # Number of forward_backward calls accumulated into .grad since the last optim_step.
    pending_grads: int = 0
    extra: dict = field(default_factory=dict)
    # In-flight sampling requests using this adapter; an adapter with users is never evicted.
    users: int = 0
    # Pool tick of the last acquire: the least recently used idle sampler adapter is evicted first.
    last_used: int = 0
    # Layer name -> output row blocks its checkpoint layout splits it into (MultiLoraLinear.out_split).
    splits: dict[str, tuple[int, ...]] = field(default_factory=dict)

    def parameters(self) -> list[torch.Tensor]:
        return [t for ab in self.weights.values() for t in ab]


class AdapterPool:
    def __init__(self, layers: dict[str, "MultiLoraLinear | ExpertsParam"], max_rank: int,
                 device: torch.device = torch.device("cpu")):
        self.layers = layers
        # Adapters are fp32 whatever the base model's dtype (engine/precision.py), on its device.
        self.device = device
        self.max_rank = max_rank
        self.adapters: dict[str, Adapter] = {}
        self._next_slot = 0
        self._tick = 0

    def __contains__(self, key: str) -> bool:
        return key in self.adapters

    def get(self, key: str) -> Adapter:
        adapter = self.adapters.get(key)
        if adapter is None:
            raise NotFoundError(f"unknown model_id {key!r}")
        return adapter

    def layer_names(self, spec: LoraSpec) -> list[str]:
        targets = targets_for(spec.train_attn, spec.train_mlp, spec.train_unembed)
        return [name for name in self.layers if name.rsplit(".", 1)[-1] in targets]

    def create(self, key: str, spec: LoraSpec, trainable: bool = True) -> Adapter:
        """A fresh adapter initialised as PEFT does: A Kaiming-uniform, B zero (equals the base)."""
        if key in self.adapters:
            raise UserError(f"model_id {key!r} already exists")
        # No upper bound here: --max-lora-rank is an admission rule (api), and a run accepted under a
        # higher one must still rebuild after a restart with a lower one (docs/op-contract.md).
        if spec.rank < 1:
            raise UserError(f"LoRA rank must be at least 1, got {spec.rank}")
        names = self.layer_names(spec)
        if not names:
            raise UserError("LoRA config targets no layer: enable train_attn, train_mlp or train_unembed")
        seed = spec.seed if spec.seed is not None else secrets.randbits(63)
        gen = torch.Generator().manual_seed(seed)
        weights = {}
        for name in names:
            layer = self.layers[name]
            a_shape, b_shape = layer.lora_shapes(spec.rank)
            a = torch.empty(a_shape, dtype=torch.float32)
            layer.init_a(a, gen)  # on the CPU: the seeded generator is a CPU one, so every device gets the same A
            a = a.to(self.device)
            b = torch.zeros(b_shape, dtype=torch.float32, device=self.device)
            weights[name] = (a.requires_grad_(trainable), b.requires_grad_(trainable))
        return self._attach(key, spec, weights, trainable)

    def create_from_tensors(
        self, key: str, spec: LoraSpec, weights: dict[str, tuple[torch.Tensor, torch.Tensor]], trainable: bool
    ) -> Adapter:
        if key in self.adapters:
            raise UserError(f"model_id {key!r} already exists")
        unknown = set(weights) - set(self.layers)
        if unknown:
            raise UserError(f"checkpoint has LoRA weights for layers this model lacks: {sorted(unknown)[:3]}")
        for name, (a, b) in weights.items():
            a_shape, b_shape = self.layers[name].lora_shapes(spec.rank)
            if tuple(a.shape) != a_shape or tuple(b.shape) != b_shape:
                raise UserError(f"checkpoint LoRA shapes for {name} do not fit this base model")
        weights = {
            n: (a.detach().float().to(self.device, copy=True).requires_grad_(trainable),
                b.detach().float().to(self.device, copy=True).requires_grad_(trainable))
            for n, (a, b) in weights.items()
        }
        return self._attach(key, spec, weights, trainable)

    def _attach(self, key: str, spec: LoraSpec, weights, trainable: bool) -> Adapter:
        slot = self._next_slot
        self._next_slot += 1
        adapter = Adapter(key=key, slot=slot, spec=spec, weights=weights, trainable=trainable)
        adapter.splits = {n: s for n in weights if (s := getattr(self.layers[n], "out_split", None))}
        if trainable:
            adapter.optimizer = new_adamw(adapter.parameters())
        for name, (a, b) in weights.items():
            self.layers[name].adapters[slot] = LoraWeights(a, b, spec.scaling)
        self.adapters[key] = adapter
        return adapter

    def remove(self, key: str) -> None:
        adapter = self.adapters.pop(key, None)
        if adapter is None:
            return
        for name in adapter.weights:
            self.layers[name].adapters.pop(adapter.slot, None)

    # -- sampler adapters: use counts and LRU eviction ----------------------------------------------

    def acquire(self, key: str) -> Adapter:
        """Mark `key` in use by one more in-flight request (and most recently used)."""
        adapter = self.get(key)
        self._tick += 1
        adapter.users += 1
        adapter.last_used = self._tick
        return adapter

    def release(self, adapter: Adapter) -> None:
        adapter.users = max(0, adapter.users - 1)

    def retire(self, key: str) -> None:
        """Move a stale sampler adapter (its files were re-saved) out of the way of its key.

        It stays attached, under a key no lookup uses, while requests still decode with it, and is
        the first to go once idle.
        """
        adapter = self.adapters.pop(key, None)
        if adapter is None:
            return
        if adapter.users == 0:
            self._detach(adapter)
            return
        adapter.key = f"{key}\0retired-slot-{adapter.slot}"
        adapter.last_used = -1
        self.adapters[adapter.key] = adapter

    def evict_idle(self, keep: int) -> list[str]:
        """Remove idle sampler adapters, least recently used first, until at most `keep` remain.

        Adapters with users stay even when that leaves more than `keep`: the bound is soft, and
        the next call catches up. Returns the evicted keys.
        """
        samplers = [a for a in self.adapters.values() if not a.trainable]
        excess = len(samplers) - keep
        evicted = []
        for adapter in sorted((a for a in samplers if a.users == 0), key=lambda a: a.last_used):
            if excess <= 0:
                break
            self.adapters.pop(adapter.key)
            self._detach(adapter)
            evicted.append(adapter.key)
            excess -= 1
        return evicted

    def evict(self, key: str) -> bool:
        """Remove one idle sampler adapter (a session that stopped heart-beating used it); False if
        it is not here, is a training adapter, or an in-flight request holds it."""
        adapter = self.adapters.get(key)
        if adapter is None or adapter.trainable or adapter.users > 0:
            return False
        del self.adapters[key]
        self._detach(adapter)
        return True

    def _detach(self, adapter: Adapter) -> None:
        for name in adapter.weights:
            self.layers[name].adapters.pop(adapter.slot, None)

