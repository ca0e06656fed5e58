"""A bf16 unembedding's forward GEMM in training through a oneDNN-packed copy of its weight.

A bf16 head runs in row chunks through autograd (engine/head.py), and each chunk's `F.linear` hands
oneDNN the plain [V, H] weight, which its AMX kernels re-lay out on every call: SmolLM2's 49k x 576
head, 128 rows, 2 threads, Intel Xeon with AMX, 7.5-8.8 ms a chunk, against 4.3 ms from the weight
packed once for the inner product, as the sampler packs it (lora/layers.py: pack_for_decode). The
copy is the sampler's own: whichever of the two packs first, the other uses it (56 MB for SmolLM2,
the head's size again in bf16). The input gradient stays autograd's `d @ W` on the plain weight: a
packed W^T was 1.25x faster there but rounded other bits at some row counts (5 and 17 rows).

It is taken only where it changes no bit: before first use, the packed product is checked against
`F.linear` on random rows at every row count up to the head's chunk and a few more (probe_rows), on
this machine and build; where any differs the head keeps `F.linear`. So a step's numbers are the same
whether or not the head has been packed yet (a replay after a crash, a sampler that packed first).
"""

from __future__ import annotations

import logging

import torch

log = logging.getLogger(__name__)


class PackedLinear(torch.autograd.Function):
    """x [M, H] W^T through W's packed copy; the input gradient d W through the plain weight, as
    autograd's linear computes it. W is frozen: no gradient."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, packed: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        from tinkerd.engine.lora.layers import packed_linear_2d

        ctx.save_for_backward(weight)
        return packed_linear_2d(x, packed, None)

    @staticmethod
    def backward(ctx, d: torch.Tensor):
        (weight,) = ctx.saved_tensors
        return d.mm(weight), None, None


class HeadPack:
    """The training side of one head layer's packed weight (`layer.packed_weight`, shared with the
    sampler): packs it on first use and checks that it gives F.linear's bits (module docstring)."""

    def __init__(self, layer, max_rows: int):
        self.layer = layer
        self.max_rows = max_rows  # the head's largest chunk (engine/head.py)
        self.unpackable = False  # packing failed here once: not tried again
        self._checked: tuple[torch.Tensor, bool] | None = None  # (the packed tensor checked, its verdict)

    def weight_for(self, x: torch.Tensor) -> torch.Tensor | None:
        """The packed weight to run x through, or None for F.linear."""
        layer = self.layer
        if x.dim() != 2 or x.shape[0] > self.max_rows or x.dtype != layer.base.weight.dtype or self.unpackable:
            return None
        packed = layer.packed_weight
        if packed is None:
            from tinkerd.engine.lora.layers import _pack

            try:
                packed = layer.packed_weight = _pack(layer.base.weight.detach(), conv=False)
            except (RuntimeError, AttributeError) as e:  # no oneDNN op here: F.linear, as before
                log.info("packing the head for training failed (%s): it keeps F.linear", e)
                self.unpackable = True
                return None
        if self._checked is None or self._checked[0] is not packed:
            self._checked = (packed, same_bits(layer.base.weight.detach(), packed, probe_rows(self.max_rows)))
            if not self._checked[1]:
                log.info("the packed head rounds otherwise than F.linear on this CPU: training keeps F.linear")
        return packed if self._checked[1] else None


def probe_rows(max_rows: int) -> list[int]:
    """Row counts the check runs: every count up to 32 (where GEMM kernels switch), the chunk and its
    neighbours, and powers of two between."""
    rows = set(range(1, min(32, max_rows) + 1)) | {max_rows - 1, max_rows}
    rows |= {n for n in (48, 64, 96, 127, 128, 256, 512) if n <= max_rows}
    return sorted(n for n in rows if n >= 1)


def same_bits(weight: torch.Tensor, packed: torch.Tensor, rows: list[int]) -> bool:
    """Whether x W^T through `packed` equals F.linear's to the bit for random x of each row count."""
    from tinkerd.engine.lora.layers import packed_linear_2d

    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for m in rows:
            x = torch.randn(m, weight.shape[1], generator=gen).to(weight.dtype)
            try:
                got = packed_linear_2d(x, packed, None)
            except RuntimeError:
                return False
            if not torch.equal(got, torch.nn.functional.linear(x, weight)):
                return False
    return True


def install(model: torch.nn.Module, device: str, max_rows: int) -> bool:
    """Give a bf16 CPU model's wrapped head a HeadPack (`max_rows`: its largest chunk); True if it got one.
    Nothing is packed yet: that waits for the first training pass through the head."""
    from tinkerd.engine.lora.layers import MultiLoraLinear

    head = model.get_output_embeddings()
    if (device != "cpu" or not isinstance(head, MultiLoraLinear) or head.base.weight.dtype != torch.bfloat16
            or head.base.bias is not None or not torch.backends.mkldnn.is_available()
            or not torch.ops.mkldnn._is_mkldnn_bf16_supported()):
        return False
    head.head_pack = HeadPack(head, max_rows)
    return True
