"""The multi-slot LoRA layer: one base Linear, many adapters, a per-row slot mapping.

Every adapter lives in a slot (an int). Before a forward pass the engine sets `LoraContext.groups`:
which rows of the batch use which slot. Each wrapped Linear then adds, for each group,
    scaling_s * (x[rows] @ A_s^T) @ B_s^T
to the base output. Adapters of different ranks coexist because each slot keeps its own A [R, in]
and B [out, R]. Rows whose slot has no adapter on this layer (or slot -1) get the base model.

For sampling on CPU the base weight can also be kept pre-packed for oneDNN (`pack_for_decode`;
q/k/v and gate/up side by side, `PackedStack`):
measured on SmolLM2-135M, 1 thread, 8 rows, all 211 linears: 42-87 ms per pass packed against
78-129 ms through F.linear (MKL's skinny-M sgemm), and each row's output is bit-identical whatever
the number of rows. Training never uses the packed copy (it has no autograd); logprobs of the two
paths agree within 2.5e-5 on SmolLM2 (the sampler's tolerance against the trainer is 1e-4).

The packing is oneDNN's 1x1 convolution's (except on an Intel CPU, below), not its inner product's:
the M rows of x [M, in] are M positions of one image, x itself is that image in channels-last
layout, and so is the output [M, out], so no copy is made either way. oneDNN runs such a convolution
through its brgemm 1x1 kernel, which streams the packed weight faster than the inner-product kernel
at decode's few rows (benchmarks/packing.py; AMD Zen 4, 1 thread, SmolLM2's body linears streamed
from memory: 25 against 28 ms at 8 rows, 23 against 33 at 2; the 49k-row head 5.4 against 6.8-8.3
ms), equal from ~24 rows. The kernel's weight layout depends on the number of positions (48-row
blocks below 64 positions, 64-row blocks from 64 up, on this CPU), and a call whose layout differs
from the packed one re-packs the weight on every call (~40x slower), so calls take at most
ROWS_PER_CALL rows: prefill's 128-row chunks run as three GEMMs of ~43 rows, ~10% slower than one
inner product of 128. On a CPU where that does not hold, pack_for_decode measures it and packs for
the inner product instead.

On an Intel CPU with AVX-512 (engine/cpu.py) fp32 packs for the inner product from the start, with
no timing check: its brgemm is the faster there at every row count a step runs (Xeon with AMX,
SmolLM2's 30 layers of body linears, 2 threads: 23.9 against 25.8 ms at 1 row, 30.2 / 32.2 at 8,
49.8 / 52.7 at 32; 1 thread 5-9% faster too; the head alike), and a prefill chunk of 128 rows is one
GEMM, 120 ms against 161 for the convolution's three of ~43. Its rows keep their bits whatever the
number of rows beside them from 2 rows up; a lone row of the 1536-wide down projection rounds
otherwise there, within the sampler's tolerance.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field

import torch
from torch import nn

from tinkerd.engine import cpu
from tinkerd.engine.lora import batched, casts, deltanet, fused, packed_head
from tinkerd.engine.precision import lora_delta, lora_delta_add

log = logging.getLogger(__name__)

# HF module names of the layers tinkerd can adapt, grouped as the SDK's LoraConfig flags name them.
# Qwen3.5's Gated DeltaNet (linear attention) layers count as attention: their fused q|k|v input
# projection, the output gate's input projection and the output projection (in_proj_a/in_proj_b,
# one scalar per head for the decay and the write strength, stay frozen, as hosted Tinker's
# exports of Qwen3.5 have none).
LINEAR_ATTN_TARGETS = ("in_proj_qkv", "in_proj_z", "out_proj")
ATTN_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj") + LINEAR_ATTN_TARGETS
MLP_TARGETS = ("gate_proj", "up_proj", "down_proj")
# A fused experts module's 3-D parameters (lora/experts.py), also in the SDK's train_mlp group
# ("including MoE layers"). wrap_model wraps only nn.Linear, so these names wrap nothing there.
EXPERT_TARGETS = ("gate_up_proj", "down_proj")
UNEMBED_TARGET = "lm_head"


@dataclass
class SlotGroup:
    slot: int
    # Row indices into the batch; None means every row (the common single-adapter case, no gather).
    rows: torch.Tensor | None
    # Rows in the whole batch (all groups): a 2-D input with more rows than this holds each row's
    # tokens flattened row-major (a MoE block's shared expert gets [B * T, H]), see token_rows.
    total: int = 0
    # The group's own padded width (tokens per row) when the batch is wider: several training runs
    # in one pass (engine/cotrain.py, LoraContext.blocks) pad every row to the widest run's, and each
    # adapter's delta is computed on its rows cut back to its own width, so its LoRA gradient sums
    # exactly the positions it sums when the op runs alone, in the same order. None: the batch's width.
    width: int | None = None

    def token_rows(self, x: torch.Tensor) -> torch.Tensor:
        """This group's indices into dim 0 of x: its batch rows, or for flattened tokens [B * T, in]
        every token of its rows."""
        n = x.shape[0]
        if x.dim() != 2 or n == self.total or self.total <= 0:
            return self.rows
        if n % self.total:
            raise RuntimeError(f"{n} flattened tokens do not split into the batch's {self.total} rows")
        per = n // self.total
        return (self.rows[:, None] * per + torch.arange(per, device=self.rows.device)).reshape(-1)


@dataclass
class LoraContext:
    """Per-forward routing shared by every MultiLoraLinear of one base model."""

    groups: list[SlotGroup] = field(default_factory=list)
    # True while the sampler runs a forward (no autograd): base linears use their packed weight when
    # they have one, and adapter deltas are added in place. Training never sets it, so its numbers
    # do not move by even one ulp.
    sampling: bool = False
    # The groups' rows are consecutive blocks, in order, covering the batch (engine/cotrain.py): the
    # layer adds all groups' deltas with one add instead of an out-of-place index_add per group,
    # each a copy of the whole [B, T, out] output (4 runs on SmolLM2: ~5 GB of copies per pass).
    blocks: bool = False

    def set_single(self, slot: int) -> None:
        self.groups = [SlotGroup(slot, None)]

    def set_rows(self, row_slots: list[int]) -> None:
        """Route row i of the next batch to adapter slot row_slots[i] (-1 = base model)."""
        if len(set(row_slots)) == 1:
            self.set_single(row_slots[0])
            return
        by_slot: dict[int, list[int]] = {}
        for i, s in enumerate(row_slots):
            by_slot.setdefault(s, []).append(i)
        self.groups = [SlotGroup(s, torch.tensor(rows, dtype=torch.long), len(row_slots)) for s, rows in by_slot.items()]

    def clear(self) -> None:
        self.groups = []
        self.blocks = False


@dataclass
class LoraWeights:
    a: torch.Tensor  # [R, in]
    b: torch.Tensor  # [out, R]
    scaling: float
    casts: tuple | None = field(default=None, repr=False, compare=False)  # a frozen adapter's bf16 copies (lora/casts.py)


class MultiLoraLinear(nn.Module):
    def __init__(self, base: nn.Linear, ctx: LoraContext):
        super().__init__()
        self.base = base
        self.ctx = ctx
        # Not registered as parameters: adapters belong to the pool, not to the base model's
        # state_dict, and come and go at run time.
        self.adapters: dict[int, LoraWeights] = {}
        # oneDNN-packed copy of base.weight for inference (see pack_for_decode); None = not packed.
        self.packed_weight: torch.Tensor | None = None
        # Or, for q/k/v and gate/up: (the siblings' stacked packed weight, this one's place in it).
        self.stack: tuple[PackedStack, int] | None = None
        # Output row blocks that checkpoints store as separate LoRAs (Qwen3.5's fused in_proj_qkv:
        # q | k | v, lora/deltanet.py); None = one.
        self.out_split: tuple[int, ...] | None = None
        # A bf16 head's forward in training through packed_weight (lora/packed_head.py); None = F.linear.
        self.head_pack: "packed_head.HeadPack | None" = None

    @property
    def in_features(self) -> int:
        return self.base.in_features

    @property
    def out_features(self) -> int:
        return self.base.out_features

    @property
    def weight(self) -> torch.Tensor:
        return self.base.weight

    def lora_shapes(self, rank: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Shapes of one adapter's (A, B) on this layer."""
        return (rank, self.in_features), (self.out_features, rank)

    def init_a(self, a: torch.Tensor, generator: torch.Generator) -> None:
        torch.nn.init.kaiming_uniform_(a, a=math.sqrt(5), generator=generator)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.ctx.sampling:
            if self.stack is not None:
                out = self.stack[0].part(x, self.stack[1])
            elif self.packed_weight is not None:
                out = _packed_linear(x, self.packed_weight, self.base.bias)
            else:
                out = self.base(x)
            return self._add_adapters_inplace(x, out)
        groups = self.ctx.groups
        if self.ctx.blocks or (len(groups) == 1 and groups[0].rows is None):
            loras = [self.adapters.get(group.slot) for group in groups]
            if fused.fits(x, self.base, loras):  # one autograd node, deltas summed in by the GEMMs
                return fused.lora_linear(x, self.base, fused.parts_of(x, groups, loras), loras,
                                         self.ctx.blocks and batched.fits(x, groups, loras, probe=fused.keeps_bits))
        packed = None if self.head_pack is None else self.head_pack.weight_for(x)
        out = self.base(x) if packed is None else packed_head.PackedLinear.apply(x, packed, self.base.weight)
        if self.ctx.blocks and x.dim() == 3:
            return self._add_blocks(x, out)
        for group in self.ctx.groups:
            lw = self.adapters.get(group.slot)
            if lw is None:
                continue
            if lw.a.dtype != out.dtype:  # bf16 base, fp32 master adapter (engine/precision.py)
                out = _mixed_add(out, x, lw, group.rows)
            elif group.rows is None:
                out = out + lora_delta(x, lw.a, lw.b, lw.scaling)
            else:
                rows = group.token_rows(x)
                delta = lora_delta(x[rows], lw.a, lw.b, lw.scaling)
                out = out.index_add(0, rows, delta)
        return out

    def _add_blocks(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """out [B, T, out] plus each group's delta on its block of rows, at its own width, zeros past
        it and for a group without this layer (x + 0 is x): per element the one add its op alone does.
        The blocks are views from one split (its backward is one cat, where a slice per group made a
        zero-filled [B, T, in] gradient per group), and a group at the batch's width is not padded."""
        groups = self.ctx.groups
        loras = [self.adapters.get(group.slot) for group in groups]
        if all(lw is None for lw in loras):
            return out
        t = x.shape[1]
        if batched.fits(x, groups, loras):
            return out + batched.same_shape_deltas(x, loras)
        parts = []
        for group, lw, xs in zip(groups, loras, x.split([group.rows.shape[0] for group in groups])):  # [B_g, T, in]
            if lw is None:
                parts.append(out.new_zeros(xs.shape[0], t, out.shape[2]))
                continue
            w = group.width or t
            if w < t:
                xs = xs[:, :w]
            # A bf16 base casts the fp32 master A/B, as lora_delta_add does (engine/precision.py; lora/casts.py).
            delta = lora_delta(xs, *casts.cast_pair(lw, xs.dtype), lw.scaling)
            parts.append(delta if w == t else torch.nn.functional.pad(delta, (0, 0, 0, t - w)))
        return out + (parts[0] if len(parts) == 1 else torch.cat(parts))

    def _add_adapters_inplace(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """The same sum without autograd: in place, scaling folded into addmm_ / index_add_.

        Decoding 4 adapters' rows through SmolLM2's 211 linears runs this 844 times per token, so
        the 3 kernels per group instead of 5 are a measurable share of a fused step.
        """
        if not self.ctx.groups:
            return out
        for group in self.ctx.groups:
            lw = self.adapters.get(group.slot)
            if lw is None:
                continue
            if lw.a.dtype != out.dtype:  # the training path's numbers, so the sampler agrees with it
                out.copy_(_mixed_add(out, x, lw, group.rows))
            elif group.rows is None:
                x2 = x.reshape(-1, x.shape[-1])  # [M, in]: every position of every row
                out.view(-1, out.shape[-1]).addmm_(x2 @ lw.a.t(), lw.b.t(), alpha=lw.scaling)
            else:  # rows index dim 0 (batch rows), whatever the trailing token dims
                rows = group.token_rows(x)
                out.index_add_(0, rows, (x[rows] @ lw.a.t()) @ lw.b.t(), alpha=lw.scaling)
        return out


def _mixed_add(out: torch.Tensor, x: torch.Tensor, lw: LoraWeights, rows: torch.Tensor | None) -> torch.Tensor:
    """One group's LoRA delta on a bf16 layer with fp32 master A/B (lora_delta_add). The delta of a
    subset of rows is computed as for those rows alone, so a row routed with other adapters' rows
    gets the same numbers as alone."""
    a, b = casts.cast_pair(lw, x.dtype)  # a sampling adapter's bf16 copies are kept (lora/casts.py)
    if rows is None:
        return lora_delta_add(out, x, a, b, lw.scaling)
    rows = rows.to(out.device)  # LoraContext builds its row lists on the CPU
    delta = lora_delta(x[rows], a, b, lw.scaling)
    return out.index_add(0, rows, delta)


# Most rows one 1x1-convolution GEMM takes (module docstring): below the 64 positions at which
# oneDNN switches weight layouts on AVX-512, with room to spare.
ROWS_PER_CALL = 48
# Most output rows of a weight _conv_packing_holds times (its docstring says why that suffices).
CHECK_OUT_ROWS = 8192


def _pack(weight: torch.Tensor, conv: bool) -> torch.Tensor:
    """weight [out, in] packed for oneDNN's 1x1 convolution ([out, in, 1, 1]) or inner product ([out, in])."""
    if not conv:
        return torch.ops.mkldnn._reorder_linear_weight(weight, 8)
    four_d = weight[:, :, None, None].contiguous().to_mkldnn()
    return torch._C._nn.mkldnn_reorder_conv2d_weight(
        four_d, [0, 0], [1, 1], [1, 1], 1, [1, weight.shape[1], 1, ROWS_PER_CALL]
    )


def _conv_1x1(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    # as_strided, one op where view + permute are two: the op itself costs ~24 us, the wrapper
    # around it was another ~7.
    x = x.contiguous()
    m, k = x.shape
    image = x.as_strided((1, k, 1, m), (m * k, 1, m * k, k))  # [1, in, 1, M], channels-last
    out = torch.ops.mkldnn._convolution_pointwise(image, packed, bias, [0, 0], [1, 1], [1, 1], 1, "none", [], "")
    n = out.shape[1]
    return out.as_strided((m, n), (n, 1))  # channels-last [1, out, 1, M] is [M, out]


def packed_linear_2d(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [M, in] through a weight packed by pack_for_decode -> [M, out]."""
    if packed.dim() == 2:  # packed for the inner product; the 1x1 convolution's is [out, in, 1, 1]
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    m = x.shape[0]
    if m <= ROWS_PER_CALL:
        return _conv_1x1(x, packed, bias)
    # Even parts: 129 rows as 43+43+43, not 48+48+33 (each part streams the whole weight).
    parts = x.tensor_split(-(-m // ROWS_PER_CALL))
    return torch.cat([_conv_1x1(part, packed, bias) for part in parts])


def _packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    out = packed_linear_2d(x.reshape(-1, x.shape[-1]), packed, bias)  # [M, out]
    return out.view(*x.shape[:-1], out.shape[-1])


# Siblings that read one input, packed side by side (PackedStack), by their HF attribute names.
STACKED = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


class PackedStack:
    """Sibling linears of one input (q|k|v, gate|up) packed as one weight for the sampler.

    One GEMM over the stacked weight streams it faster than one per part: at 8 rows on SmolLM2 a
    576x960 q|k|v ran ~25% faster than its three parts, a 576x3072 gate|up ~7% faster than its two
    halves (decode.py calls the stack directly). The parts then need no packed copy of their own.
    Through the HF modules (prefill), each member asks for its slice: the output for the last input
    is kept, so siblings called next with the same tensor (HF calls q_proj, k_proj, v_proj on one
    hidden state) take theirs without another GEMM, and it is dropped once every member took its
    slice. A member asking again for the same input gets a fresh GEMM: its slice may already hold
    its adapters' deltas, added in place.
    """

    def __init__(self, members: list[MultiLoraLinear], conv: bool):
        self.members = members
        self.sizes = [m.out_features for m in members]
        self.offsets = [sum(self.sizes[:i]) for i in range(len(members))]
        biases = [m.base.bias for m in members]
        self.bias = None if biases[0] is None else torch.cat([b.detach() for b in biases])
        weight = torch.cat([m.base.weight.detach() for m in members])  # [sum of outs, in]
        self.packed = _pack(weight, conv)
        self._last: tuple[torch.Tensor, torch.Tensor, set[int]] | None = None  # (input, output, members served)

    def part(self, x: torch.Tensor, i: int) -> torch.Tensor:
        """Member i's output for x [..., in]: a view [..., out_i] of the stacked output."""
        last = self._last
        if last is None or last[0] is not x or i in last[2]:
            last = self._last = (x, _packed_linear(x, self.packed, self.bias), set())
        last[2].add(i)
        if len(last[2]) == len(self.members):
            self._last = None
        return last[1].narrow(-1, self.offsets[i], self.sizes[i])


def _stacks(layers: dict[str, MultiLoraLinear]) -> list[list[MultiLoraLinear]]:
    """Groups of sibling layers to stack: all of a STACKED group present, same input, same bias use."""
    groups = []
    for name, layer in layers.items():
        parent, _, attr = name.rpartition(".")
        for names in STACKED:
            if attr != names[0]:
                continue
            members = [layers.get(f"{parent}.{n}" if parent else n) for n in names]
            if all(m is not None for m in members) and len({(m.in_features, m.base.bias is None) for m in members}) == 1:
                groups.append(members)
    return groups


def _call_costs(x: torch.Tensor, packs: dict[bool, torch.Tensor], runs: int) -> dict[bool, float]:
    """The fastest of `runs` calls of each packing on x, in seconds."""
    cost = {}
    for conv, packed in packs.items():
        times = []
        for _ in range(runs):
            t = time.perf_counter()
            packed_linear_2d(x, packed, None)
            times.append(time.perf_counter() - t)
        cost[conv] = min(times)
    return cost


def _conv_packing_holds(shapes: list[tuple[int, int]]) -> bool:
    """Whether the 1x1-convolution packing of a weight of each of `shapes` ([out, in]) serves every
    row count up to ROWS_PER_CALL at most 4x as slowly as the inner product's. Where the kernel's
    layout for a row count differs from the packed one, every such call re-packs the weight: 40-160x
    slower on SmolLM2's linears, and 200x on a 152k-row head (0.7 s per decode step). Otherwise
    0.7-1.3x there, and up to ~2.3x on toy linears of 64 x 64, where oneDNN's fixed cost per call
    (24 us against 14) is all there is.

    Every shape and every row count, because which ones re-pack is not regular: on an AVX2 EPYC,
    1536 x 576 re-packs at 1, 2, 3, 5, 6, 9, 10, 13, ... rows, 128 x 64 at none of 1 and 48 but
    64 x 128 at 8 (benchmarks/packing.py). Smallest shapes first: a CPU where it fails pays one
    small re-pack, not the head's. A shape is checked with at most CHECK_OUT_ROWS of its output rows:
    which row counts re-pack depends on the input width, not on how many output rows follow (on that
    EPYC 8192 x 576 and 49152 x 576 re-pack at the same 17 row counts, 8192 x 64 at 16 of the 17 of
    151936 x 64), and a large model's head (151936 x 4096: 2.5 GB) would take a minute and two more
    copies to check whole."""
    gen = torch.Generator().manual_seed(0)
    capped = {(min(out, CHECK_OUT_ROWS + out % 64), k) for out, k in shapes}
    for shape in sorted(capped, key=math.prod):
        weight = torch.randn(shape, generator=gen)
        packs = {conv: _pack(weight, conv) for conv in (True, False)}
        for m in range(1, ROWS_PER_CALL + 1):
            x = torch.randn(m, shape[1], generator=gen)
            for conv, packed in packs.items():
                packed_linear_2d(x, packed, None)  # oneDNN builds the primitive on the first call
            cost = _call_costs(x, packs, 2)
            if cost[True] > 4 * cost[False]:
                # A re-pack is slow on every call; a load spike on a busy machine is not: confirm
                # with more calls before giving up the convolution for every linear.
                cost = _call_costs(x, packs, 6)
            if cost[True] > 4 * cost[False]:
                log.warning("oneDNN's 1x1 convolution is %.0fx slower than its inner product for a %d x %d weight "
                            "at %d rows here: packing for the inner product", cost[True] / cost[False], *shape, m)
                return False
    return True


def pack_for_decode(layers: dict[str, MultiLoraLinear]) -> bool:
    """Give every fp32 or bf16 CPU base linear a oneDNN-packed weight for the sampler; True if packed.

    q/k/v and gate/up are packed together (PackedStack), the others alone. fp32: for the inner
    product on an Intel CPU with AVX-512 (module docstring), elsewhere for the 1x1 convolution unless
    it is slow on this CPU (_conv_packing_holds), then for the inner product.
    bf16 (where oneDNN has bf16 kernels): for the inner product, which gave F.linear's bits at 1.4-1.5x
    its speed on SmolLM2's linears at 8 rows and 2.2x on its head, 1 thread, AVX-512 bf16 (the 1x1
    convolution was slower than the inner product there and rounded differently). Costs one more
    copy of the wrapped weights in memory (540 MB for SmolLM2-135M in fp32). Skipped (with a log
    line, results are the same within 1e-4, only slower) where oneDNN or the op is missing.
    """
    sample = next(iter(layers.values()), None)
    dtype = None if sample is None else sample.weight.dtype
    if sample is None or sample.weight.device.type != "cpu" or dtype not in (torch.float32, torch.bfloat16):
        return False
    if not torch.backends.mkldnn.is_available():
        log.info("oneDNN is not available: the sampler uses unpacked linear weights")
        return False
    if dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return False  # bf16 in oneDNN emulated: F.linear's own path
    try:
        stacks = [members for members in _stacks(layers) if members[0].stack is None]
        stacked = {id(m) for members in stacks for m in members}
        shapes = [(sum(m.out_features for m in members), members[0].in_features) for members in stacks]
        shapes += [tuple(layer.weight.shape) for layer in layers.values() if id(layer) not in stacked]
        conv = dtype == torch.float32 and not cpu.mkl_avx512() and _conv_packing_holds(shapes)
        for members in stacks:
            if members[0].stack is None:
                stack = PackedStack(members, conv)
                for i, m in enumerate(members):
                    m.stack = (stack, i)
        for layer in layers.values():
            if layer.stack is None and layer.packed_weight is None:
                layer.packed_weight = _pack(layer.base.weight.detach(), conv)
        # One check that the private op still computes a linear (it is inductor's, not public API).
        x = torch.randn(3, sample.in_features, generator=torch.Generator().manual_seed(0)).to(dtype)
        want = torch.nn.functional.linear(x, sample.base.weight.detach(), sample.base.bias)
        if sample.stack is not None:
            stack, i = sample.stack
            got = _packed_linear(x, stack.packed, stack.bias).narrow(-1, stack.offsets[i], stack.sizes[i])
        else:
            got = _packed_linear(x, sample.packed_weight, sample.base.bias)
        tol = 1e-4 if dtype == torch.float32 else 2e-2  # bf16: a last-bit difference is ~0.4%
        if not torch.allclose(got.float(), want.float(), rtol=tol, atol=tol):
            raise RuntimeError(f"packed linear differs by {(got - want).abs().max().item():.3g}")
    except (RuntimeError, AttributeError) as e:
        log.warning("packing linear weights for decode failed (%s): the sampler uses unpacked weights", e)
        for layer in layers.values():
            layer.packed_weight = None
            layer.stack = None
        return False
    return True


def wrap_model(model: nn.Module, ctx: LoraContext, targets: tuple[str, ...]) -> dict[str, MultiLoraLinear]:
    """Replace every nn.Linear whose attribute name is in `targets` by a MultiLoraLinear.

    Returns the wrapped layers by their full module name (HF naming, e.g.
    `model.layers.0.self_attn.q_proj`, `lm_head`), the key adapters use for their weights.
    """
    wrapped: dict[str, MultiLoraLinear] = {}
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            if child_name in targets and isinstance(child, nn.Linear):
                layer = MultiLoraLinear(child, ctx)
                layer.out_split = deltanet.qkv_split(module, child_name)
                setattr(module, child_name, layer)
                full = f"{name}.{child_name}" if name else child_name
                wrapped[full] = layer
    return wrapped


def targets_for(spec_attn: bool, spec_mlp: bool, spec_unembed: bool) -> tuple[str, ...]:
    return (ATTN_TARGETS if spec_attn else ()) + (tuple(dict.fromkeys(MLP_TARGETS + EXPERT_TARGETS)) if spec_mlp else ()) + (
        (UNEMBED_TARGET,) if spec_unembed else ()
    )
