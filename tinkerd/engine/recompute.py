"""Activation recomputation: a training pass whose activations would not fit in memory keeps only
some decoder layers' inputs, and runs those layers again in the backward to get the rest.

A forward_backward holds every layer's activations until its backward: on SmolLM2-135M in fp32
~1.25 MB a position, so the cookbook's RL batch of 32 samples of 64 tokens over 4 prompts of 256
held ~5 GB, and a 0.6B model with 512-token samples would pass 24 GB, where the engine process was
killed (and every tenant's in-flight work with it, control/crashes.py). Each decoder call now first
estimates what it and the pass's later calls will hold (`activation_bytes`, `Recompute.whole_pass`)
against its room (`Recompute.room`: the configured budget, --activation-memory-gb, or FREE_SHARE of
the memory free as the call starts); past it, the fewest layers that bring it within
(`Recompute.count`) keep their input hidden state alone, H values a position, and their backward first replays their forward (torch.utils.checkpoint,
non-reentrant: the replay stops once it has the tensors the backward needs). With a frozen base a
layer's backward costs about its forward, so a layer replayed costs ~40% more than one kept
(SmolLM2, every layer: a step 1.41-1.44x); a pass short of a little memory replays a few layers.

The replay runs the same calls on the same inputs, so its tensors, and so every loss, logprob and
gradient, are those of the pass without it, to the bit (tests/unit/engine/test_recompute.py). That
is why the choice may depend on the memory free at the moment: a replay after a crash computes the
same numbers whichever way it goes.

What a replay must see as the first run saw it, and so is put back for it (`_Layer`):
- the LoRA context (engine/lora/layers.py: LoraContext), which a shared pass clears after its
  forward (engine/cotrain.py) and the head's backward sets to one run at a time;
- a KV cache layer the forward appended to (engine/prefixes.py: the prompt's pass writes the cache
  its samples then read, and each sample's pass appends to its copy): the layer's entry goes back to
  what it held before, so the replay appends the same keys to the same prefix;
- and the MoE routing counts (lora/experts.py) are not counted a second time.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterator

import torch
from torch.utils.checkpoint import checkpoint

from tinkerd.engine import malloc
from tinkerd.engine.sampler.kv import kv_bytes_per_token

if TYPE_CHECKING:
    from tinkerd.engine.engine import ModelRuntime

log = logging.getLogger(__name__)

# Margin on `layer_bytes`, whose terms count the tensors a layer saves for its backward. Against
# those bytes (torch's saved-tensor hooks, rank-32 LoRA on every linear, 2 x 128 tokens) the terms
# alone gave SmolLM2-135M's widths 0.93x (fp32) and 1.03x (bf16), Qwen3-0.6B's 0.89x and 0.87x (its
# q and k norms save Q + KV more), so with the margin 1.16x, 1.28x, 1.11x and 1.09x;
# test_recompute pins it there.
MARGIN = 1.25
# Share of the memory free when a decoder call starts that its activations may take; the rest is for
# the head, the backward's gradients and whatever else the process allocates meanwhile.
FREE_SHARE = 0.8


def layer_bytes(text, dtype: torch.dtype) -> int:
    """Bytes one position's activations hold in one decoder layer until the backward: the norms'
    and residuals' 4 H values (fp32 whatever the dtype: the norms compute in it), and at the
    dtype's size q, k and v before and after rotary and the attention's output (3 (Q + KV)), the
    MLP's gate, up, activation and product (4 I: a routed MoE's k experts' and its shared one's),
    and an MoE layer's token copies to and from its k experts and their weighting (3 k H)."""
    hidden = text.hidden_size
    heads = getattr(text, "num_attention_heads", 1)
    head_dim = getattr(text, "head_dim", None) or hidden // heads
    q, kv = heads * head_dim, getattr(text, "num_key_value_heads", heads) * head_dim
    values = 3 * (q + kv)
    routed = getattr(text, "moe_intermediate_size", None)
    if routed:
        k = getattr(text, "num_experts_per_tok", 1)
        shared = getattr(text, "shared_expert_intermediate_size", 0) or 0
        values += 4 * (k * routed + shared) + 3 * k * hidden
    else:
        values += 4 * text.intermediate_size
    return 4 * hidden * 4 + values * dtype.itemsize


def activation_bytes(config, dtype: torch.dtype, positions: int) -> int:
    """About the bytes `positions` decoder positions' activations take until the backward."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return int(MARGIN * positions * text.num_hidden_layers * layer_bytes(text, dtype))


def free_bytes(device: torch.device) -> int:
    """Memory this process could still take: on a GPU the device's free memory and the caching
    allocator's free blocks (which it frees and retries with before it fails an allocation); on a
    CPU what engine/malloc.py counts: the machine's or its cgroup's, not the free blocks the
    engine's heap keeps, which a big allocation may not fit (Recompute.room gives those back first)."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device))
    left = malloc.bytes_left()
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES") if left is None else left


@dataclass
class Recompute:
    """When a training pass recomputes its layers' activations: `budget` bytes (None: a share of what
    is free when each decoder call starts; 0: always)."""

    budget: int | None = None
    calls: int = 0  # decoder calls that recomputed layers, for the log and the tests
    replayed: int = 0  # and how many layers they recomputed, all told
    # (positions, cached key positions) the pass under way has still to run, its calls included;
    # and the bytes its calls so far hold (about), which an explicit budget is shared by.
    ahead: tuple[int, int] | None = None
    spent: float = 0.0

    @contextlib.contextmanager
    def whole_pass(self, positions: int, keys: int = 0) -> Iterator[None]:
        """A pass of several decoder calls (engine/prefixes.py, engine/buckets.py) with these
        positions in all: each call then plans for what the calls after it will hold too, not just
        for itself (the first would otherwise take the room the later ones need)."""
        self.ahead, self.spent = (positions, keys), 0.0
        try:
            yield
        finally:
            self.ahead, self.spent = None, 0.0

    def count(self, rt: "ModelRuntime", positions: int, keys: int = 0) -> int:
        """How many of the decoder's layers a call over `positions` positions recomputes, its
        attention holding `keys` positions of a KV cache meanwhile (engine/prefixes.py: a sample's
        pass appends its keys to its prompt's): none when what the pass holds from here on fits in
        the room, else the fewest that bring it within, all of them at most. It holds each kept
        layer's activations, each recomputing layer's input (H values a position), the caches, and
        twice a layer's activations of this call as working space (its temporaries, a replay)."""
        if not torch.is_grad_enabled():
            return 0
        own = (positions, keys)
        if self.ahead is not None:  # this call and those after it, at the same share of their layers
            positions, keys = max(self.ahead[0], positions), max(self.ahead[1], keys)
            self.ahead = (self.ahead[0] - own[0], self.ahead[1] - own[1])
        config = rt.model.config
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        dtype, layers = rt.precision.torch_dtype, text.num_hidden_layers
        layer = activation_bytes(config, dtype, positions) / layers
        kept_input = positions * text.hidden_size * dtype.itemsize
        fixed = keys * kv_bytes_per_token(text, dtype) + 2 * layer * own[0] / positions
        room = self.room(rt, fixed + layers * layer)
        n = 0
        if fixed + layers * layer > room:
            kept = max(0, math.floor((room - fixed - layers * kept_input) / (layer - kept_input)))
            n = layers - min(layers, kept)
        if self.ahead is not None:  # what this call holds: its share of the plan
            share = own[0] / positions
            self.spent += share * ((layers - n) * layer + n * kept_input) + own[1] * kv_bytes_per_token(text, dtype)
        if not n:
            return 0
        log.debug("a decoder call over %d positions (%d cached), %d with the pass's later calls: activations "
                  "~%.2f GB, room %.2f GB: %d of %d layers recompute", own[0], own[1], positions,
                  (fixed + layers * layer) / 1e9, room / 1e9, n, layers)
        return n

    def room(self, rt: "ModelRuntime", need: float = 0) -> float:
        """Bytes more that may be held until the backward: the budget less what the pass's earlier
        calls hold, or FREE_SHARE of the free memory (which those are already out of); on a CPU short
        of `need`, after the engine's heap gave its free pages back."""
        if self.budget is not None:
            return self.budget - self.spent
        device = rt.precision.torch_device
        room = FREE_SHARE * free_bytes(device)
        if need > room and device.type == "cpu" and malloc.give_back():
            room = FREE_SHARE * free_bytes(device)
        return room

    def fits(self, rt: "ModelRuntime", nbytes: int) -> bool:
        """Whether `nbytes` more may be held until the backward (engine/head.py asks it of its logits)."""
        return nbytes <= self.room(rt, nbytes)

    @contextlib.contextmanager
    def layers(self, rt: "ModelRuntime", positions: int, keys: int = 0) -> Iterator[int]:
        """Within it the first `count` of the decoder's layers recompute in the backward; yields that count.
        Which ones does not matter for memory (every layer's activations live until the backward), nor
        for the numbers."""
        n = self.count(rt, positions, keys)
        if not n:
            yield 0
            return
        self.calls += 1
        self.replayed += n
        layers = list(rt.model.get_decoder().layers)[:n]
        own = [layer.__dict__.get("forward") for layer in layers]
        for i, layer in enumerate(layers):
            layer.forward = _Layer(rt, i, layer.forward)
        try:
            yield n
        finally:
            for layer, forward in zip(layers, own):
                del layer.forward
                if forward is not None:
                    layer.forward = forward


class _Layer:
    """One decoder layer's forward under checkpoint, its replay seeing what its first run saw."""

    def __init__(self, rt: "ModelRuntime", index: int, forward):
        self.rt, self.index, self.forward = rt, index, forward

    def __call__(self, hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        if not torch.is_grad_enabled():
            return self.forward(hidden_states, *args, **kwargs)
        ctx = self.rt.ctx
        seen = (list(ctx.groups), ctx.sampling, ctx.blocks)
        cache = kwargs.get("cache")
        entry = None if cache is None else dict(vars(cache.layers[self.index]))
        runs = []

        def run(h: torch.Tensor) -> torch.Tensor:
            if not runs:  # the forward itself
                runs.append(True)
                return self.forward(h, *args, **kwargs)
            now = (ctx.groups, ctx.sampling, ctx.blocks)
            counting = self.rt.routing.enabled
            ctx.groups, ctx.sampling, ctx.blocks = list(seen[0]), seen[1], seen[2]
            self.rt.routing.enabled = False
            if entry is not None:
                state = vars(cache.layers[self.index])
                state.clear()
                state.update(entry)
            try:
                return self.forward(h, *args, **kwargs)
            finally:
                ctx.groups, ctx.sampling, ctx.blocks = now
                self.rt.routing.enabled = counting

        return checkpoint(run, hidden_states, use_reentrant=False)

