"""Multi-slot LoRA on fused MoE experts: each token's own adapter on each expert it is routed to.

transformers 5.x stores a MoE layer's routed experts as two 3-D parameters (Qwen3MoeExperts,
Qwen3_5MoeExperts, Qwen3VLMoeTextExperts):

    gate_up_proj [E, 2I, H]   gate rows first, then up (`.chunk(2, -1)`)
    down_proj    [E, H, I]

gpt-oss (GptOssExperts, flagged `is_transposed` and not `is_concatenated` by transformers' experts
decorator) stores them the other way round, with the gate and up columns interleaved, a bias on
each, and its own clamped SwiGLU (`_apply_gate`):

    gate_up_proj [E, H, 2I]   columns g0, u0, g1, u1, ...      gate_up_proj_bias [E, 2I]
    down_proj    [E, I, H]                                     down_proj_bias    [E, H]

and the experts module is called as `experts(hidden [N, H], top_k_index [N, k], top_k_weights [N, k])`
on the flattened tokens of the batch. `MultiLoraExperts` replaces that module. For every adapter
slot each parameter carries a rank-R LoRA per expert, stacked:

    A [E, R, in]   B [E, out, R]       delta_e = scaling * B[e] @ A[e]

which is exactly PEFT's `target_parameters` LoRA (lora.ParamWrapper: its `get_delta_factors`
gives the same A [E, R, in] and B [E, out, R], for either storage order), so PEFT is the test
oracle. The gate_up LoRA's B is kept gate rows first for every family: for gpt-oss the layer
interleaves the delta's columns to the model's g0, u0, ... order, so checkpoints and the file
layout below (w1 = gate half, w3 = up half) are the same code for every family (PEFT's B for
gpt-oss has the interleaved row order; tests/parity/peft_oracle.py converts). Unlike PEFT, which adds
the delta to the whole expert stack every forward (a full copy of every expert tensor) and refuses
mixed-adapter batches, the delta here is applied as two skinny matmuls to the tokens routed to an
expert, grouped by their row's slot: a decode batch mixing tenants stays one forward.

Token -> row: the HF MoE block flattens [B, T, H] to [B*T, H] row-major, so token n belongs to
batch row n // T, with B the rows the context's groups cover (set_rows routes every row).

The loop over experts is the eager one (Qwen3MoeExperts.forward); only experts that received a
token run. Router metrics (the SDK's `e_frac_with_tokens:mean` etc.) are counted here when
`ExpertsRouting` is switched on, over the tokens `ExpertsRouting.token_mask` marks real.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.nn import functional as F

from tinkerd.engine.lora.layers import LoraContext, LoraWeights

class ExpertsParam:
    """The adapters of one 3-D expert parameter, by slot: what the pool attaches to and sizes by."""

    def __init__(self, weight: nn.Parameter, transposed: bool = False, interleaved: bool = False):
        self.weight = weight  # [E, out, in]; transposed: [E, in, out]
        self.transposed = transposed
        # Output columns g0, u0, g1, u1, ... (gpt-oss gate_up_proj); B stays gate rows first.
        self.interleaved = interleaved
        self.adapters: dict[int, LoraWeights] = {}

    @property
    def num_experts(self) -> int:
        return self.weight.shape[0]

    def lora_shapes(self, rank: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        e, out, inp = self.weight.shape
        if self.transposed:
            out, inp = inp, out
        return (e, rank, inp), (e, out, rank)

    def base(self, x: torch.Tensor, expert: int, bias: torch.Tensor | None) -> torch.Tensor:
        """x [n, in] through expert `expert`'s frozen weight (and bias)."""
        w = self.weight[expert]
        y = x @ w if self.transposed else F.linear(x, w)
        return y if bias is None else y + bias[expert]

    def _delta(self, x: torch.Tensor, lw: LoraWeights, expert: int) -> torch.Tensor:
        # A bf16 base casts the fp32 master A/B for the pass, as lora_delta_add does (engine/precision.py).
        d = (x @ lw.a[expert].to(x.dtype).t()) @ lw.b[expert].to(x.dtype).t()  # [n, out], gate rows first
        if self.interleaved:  # [g | u] -> g0, u0, g1, u1, ...
            d = d.view(d.shape[0], 2, -1).transpose(1, 2).reshape(d.shape[0], -1)
        return d

    def init_a(self, a: torch.Tensor, generator: torch.Generator) -> None:
        """Kaiming-uniform as PEFT draws its [E*R, in] lora_A: the bound depends on `in` only."""
        torch.nn.init.kaiming_uniform_(a.view(-1, a.shape[-1]), a=math.sqrt(5), generator=generator)

    def add(self, y: torch.Tensor, x: torch.Tensor, expert: int, slots: list[tuple[int, torch.Tensor | None]]) -> torch.Tensor:
        """y [n, out] (x [n, in] through expert `expert`) plus each slot's delta on its tokens.

        `slots`: (slot, positions into x) per slot among these tokens; None = all of them."""
        for slot, pos in slots:
            lw = self.adapters.get(slot)
            if lw is None:
                continue
            if pos is None:
                y = y + self._delta(x, lw, expert) * lw.scaling
            else:
                y = y.index_add(0, pos, self._delta(x[pos], lw, expert) * lw.scaling)
        return y


@dataclass
class ExpertsRouting:
    """Per-forward routing counts for the SDK's MoE metrics; off unless `enabled`."""

    enabled: bool = False
    # Per part (an op: one alone, several in a shared pass, engine/cotrain.py), [N] bool over the
    # flattened tokens of the next forward: which are its real tokens (not padding); None: all.
    token_masks: list[torch.Tensor | None] = field(default_factory=list)
    # Per part, one [E] tensor of (token, k) assignments per MoE layer call, in call order.
    counts: list[list[torch.Tensor]] = field(default_factory=list)

    @contextlib.contextmanager
    def counting(self, *token_masks: torch.Tensor | None):
        """Count routing over the forwards inside, per part (token_masks: each part's real tokens,
        [B*T] bool, or None for every token)."""
        self.enabled, self.token_masks, self.counts = True, list(token_masks), [[] for _ in token_masks]
        try:
            yield self
        finally:
            self.enabled, self.token_masks = False, []

    def count(self, mask: torch.Tensor) -> None:
        """One MoE layer's routing, mask [E, k, N] (one-hot of each token's k experts)."""
        for part, real in zip(self.counts, self.token_masks):
            part.append((mask if real is None else mask[:, :, real]).sum(dim=(1, 2)))

    def metrics(self, part: int = 0) -> dict[str, float]:
        """The SDK's definitions (tinker/types/forward_backward_output.py) for one part, averaged over layers."""
        if part >= len(self.counts) or not self.counts[part]:
            return {}
        frac_with, frac_over, max_v, min_v = [], [], [], []
        for c in self.counts[part]:
            c = c.double()
            fair = c.sum() / c.numel()
            if fair <= 0:
                continue
            frac_with.append((c > 0).double().mean().item())
            frac_over.append((c > fair).double().mean().item())
            max_v.append(((c.max() - fair) / fair).item())
            min_v.append(((c.min() - fair) / fair).item())
        if not frac_with:
            return {}
        mean = lambda v: sum(v) / len(v)  # noqa: E731
        return {"e_frac_with_tokens:mean": mean(frac_with), "e_frac_oversubscribed:mean": mean(frac_over),
                "e_max_violation:mean": mean(max_v), "e_max_violation:max": max(max_v),
                "e_min_violation:mean": mean(min_v)}


def split_runs(device: torch.device) -> bool:
    """Whether a shared training pass runs each run's tokens on an expert as their own GEMMs (for
    each run the bits of its op alone), or all runs' tokens on it as one, each token's delta by its
    slot (the sampler's mixed-tenant routing). The CPU keeps the bits; on a GPU a shared pass keeps
    no run's bits anyway (engine/cotrain.py), and one expert GEMM for all runs is 1/N of the launches."""
    return device.type == "cpu"


class MultiLoraExperts(nn.Module):
    def __init__(self, base: nn.Module, ctx: LoraContext, routing: ExpertsRouting):
        super().__init__()
        self.base = base  # the HF experts module and its parameters, frozen
        self.ctx = ctx
        self.routing = routing
        self.num_experts = base.gate_up_proj.shape[0]
        # transformers' experts decorator records the storage order on the module (gpt-oss:
        # transposed, interleaved, with biases); a class without it is Qwen's [E, out, in], gate first.
        transposed = bool(getattr(base, "is_transposed", False))
        self.gate_up = ExpertsParam(base.gate_up_proj, transposed, not getattr(base, "is_concatenated", True))
        self.down = ExpertsParam(base.down_proj, transposed)
        self.gate_up_bias = getattr(base, "gate_up_proj_bias", None)
        self.down_bias = getattr(base, "down_proj_bias", None)

    def _rows(self, n: int) -> tuple[int, int]:
        """(batch rows the context's groups cover, tokens per row) of n flattened tokens."""
        rows = sum(len(g.rows) for g in self.ctx.groups)  # set_rows puts every row of the batch in one group
        if rows <= 0 or n % rows:
            raise RuntimeError(f"{n} tokens do not split into the {rows} routed rows")
        return rows, n // rows

    def _token_slots(self, n: int) -> torch.Tensor | None:
        """None when every token uses one slot (ctx.groups[0]), else the slot of each token [n]."""
        groups = self.ctx.groups
        if len(groups) <= 1 and (not groups or groups[0].rows is None):
            return None
        rows, per = self._rows(n)
        # On the experts' device: the tokens' indices into it are there (LoraContext keeps its row
        # lists on the CPU), and a CUDA index into a CPU tensor raises.
        device = self.base.gate_up_proj.device
        per_row = torch.full((rows,), -1, dtype=torch.long, device=device)
        for g in groups:
            per_row[g.rows.to(device)] = g.slot
        return per_row.repeat_interleave(per)

    def _run_tokens(self, n: int) -> list[tuple[int, torch.Tensor]] | None:
        """In a shared training pass (ctx.blocks: each run's rows a consecutive block, engine/cotrain.py):
        per run, its slot and which of the n flattened tokens are its own, [n] bool: its rows at
        positions inside its own width (past it is the widest run's padding, which its op alone never
        has). None outside one."""
        groups = self.ctx.groups
        if not self.ctx.blocks or len(groups) < 2:
            return None
        rows, t = self._rows(n)
        device = self.base.gate_up_proj.device
        out = []
        for g in groups:
            mine = torch.zeros(rows, t, dtype=torch.bool, device=device)
            mine[g.rows.to(device), : g.width or t] = True
            out.append((g.slot, mine.flatten()))
        return out

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(hidden_states)
        single = self.ctx.groups[0].slot if self.ctx.groups else -1
        runs = self._run_tokens(hidden_states.shape[0]) if split_runs(hidden_states.device) else None
        token_slots = None if runs is not None else self._token_slots(hidden_states.shape[0])
        with torch.no_grad():
            mask = F.one_hot(top_k_index, num_classes=self.num_experts).permute(2, 1, 0)  # [E, k, N]
            if self.routing.enabled:
                self.routing.count(mask)
            hit = (mask.sum(dim=(1, 2)) > 0).nonzero()[:, 0].tolist()
        for e in hit:
            top_k_pos, token_idx = torch.where(mask[e])
            if runs is not None:
                # A shared pass: each run's tokens on this expert alone, in the order its op alone
                # has them, so its GEMMs, activation and sums see the same operands (bit for bit).
                for slot, mine in runs:
                    keep = mine[token_idx]
                    if keep.any():
                        self._expert(e, hidden_states, token_idx[keep], top_k_pos[keep], top_k_weights, [(slot, None)], out)
                continue
            if token_slots is None:
                slots = [(single, None)]
            else:
                mine = token_slots[token_idx]
                slots = [(int(s), (mine == s).nonzero()[:, 0]) for s in mine.unique().tolist()]
            self._expert(e, hidden_states, token_idx, top_k_pos, top_k_weights, slots, out)
        return out

    def _expert(self, e: int, hidden_states: torch.Tensor, token_idx: torch.Tensor, top_k_pos: torch.Tensor,
                top_k_weights: torch.Tensor, slots: list, out: torch.Tensor) -> None:
        """Expert e on the tokens token_idx (its top_k_pos-th choice for each), each slot's delta on
        its tokens, weighted, added into out."""
        x = hidden_states[token_idx]
        gate_up = self.gate_up.add(self.gate_up.base(x, e, self.gate_up_bias), x, e, slots)
        # The family's own activation: chunk + act_fn (Qwen), clamped interleaved SwiGLU (gpt-oss).
        h = self.base._apply_gate(gate_up)
        y = self.down.add(self.down.base(h, e, self.down_bias), h, e, slots)
        y = y * top_k_weights[token_idx, top_k_pos, None]
        out.index_add_(0, token_idx, y.to(out.dtype))


def wrap_experts(model: nn.Module, ctx: LoraContext, class_name: str | None,
                 routing: ExpertsRouting) -> dict[str, ExpertsParam]:
    """Replace every module of class `class_name` (a fused-experts class) by MultiLoraExperts.

    Returns its two parameters' adapter holders by adapter layer name
    (`model.layers.0.mlp.experts.gate_up_proj`, `...experts.down_proj`)."""
    params: dict[str, ExpertsParam] = {}
    if class_name is None:
        return params
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            if type(child).__name__ != class_name:
                continue
            layer = MultiLoraExperts(child, ctx, routing)
            setattr(module, child_name, layer)
            full = f"{name}.{child_name}" if name else child_name
            params[f"{full}.gate_up_proj"] = layer.gate_up
            params[f"{full}.down_proj"] = layer.down
    return params


# -- file layout ------------------------------------------------------------------------------------
# Checkpoints and exports hold expert LoRA in hosted Tinker's layout, which the cookbook's `weights`
# module reads (build_hf_model / build_lora_adapter; its expert_key_remaps map w1/w3/w2 to
# gate_proj/up_proj/down_proj): `<experts>.w1|w3|w2` with lora_A [E, R, in] and lora_B [E, out, R].
# tinkerd's one LoRA on the fused gate_up_proj is w1 and w3 sharing lora_A, lora_B split at the
# gate/up boundary (gate first): B_gate @ A and B_up @ A are exactly the two halves of B @ A.
_GATE, _UP, _DOWN = "w1", "w3", "w2"


def file_names(name: str) -> list[str]:
    """The layer names one adapter layer is stored under; a non-expert layer's own name."""
    parent, _, param = name.rpartition(".")
    if not parent.endswith(".experts") or param not in ("gate_up_proj", "down_proj"):
        return [name]
    return [f"{parent}.{_DOWN}"] if param == "down_proj" else [f"{parent}.{_GATE}", f"{parent}.{_UP}"]


def to_file_layout(name: str, a: torch.Tensor, b: torch.Tensor) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """(file layer name, A, B) for one adapter layer; a non-expert layer passes through."""
    names = file_names(name)
    if len(names) == 1:
        return [(names[0], a, b)]
    gate, up = b.chunk(2, dim=1)
    return [(names[0], a, gate), (names[1], a, up)]


def from_file_layout(weights: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Inverse of to_file_layout over a whole adapter; ValueError for expert tensors it cannot fuse."""
    out: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for name, (a, b) in weights.items():
        parent, _, leaf = name.rpartition(".")
        if not parent.endswith(".experts") or leaf not in (_GATE, _UP, _DOWN):
            out[name] = (a, b)
        elif leaf == _DOWN:
            out[f"{parent}.down_proj"] = (a, b)
        elif leaf == _GATE:
            if f"{parent}.{_UP}" not in weights:
                raise ValueError(f"{name} has no {_UP} beside it")
            a_up, b_up = weights[f"{parent}.{_UP}"]
            if a.shape != a_up.shape or not torch.equal(a, a_up):
                raise ValueError(f"{parent}: {_GATE} and {_UP} have different lora_A; tinkerd trains one LoRA on the fused gate_up_proj")
            out[f"{parent}.gate_up_proj"] = (a, torch.cat([b, b_up], dim=1))
        elif f"{parent}.{_GATE}" not in weights:
            raise ValueError(f"{name} has no {_GATE} beside it")
    return out
