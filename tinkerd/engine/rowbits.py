"""At which row counts this machine's GEMMs give a row of a model's linears other bits than in a big batch.

A shared training pass (engine/cotrain.py) runs the frozen linears of the body once over every
run's rows, and the head's GEMMs over consecutive blocks of several runs. Each run gets the bits of
its op alone only if a row's output is the same in the GEMM its op runs alone and in the shared
one. That is a property of the BLAS, of the kernels it picks for the CPU it finds and of the thread
count, not of torch. MKL's sgemm (fp32, SmolLM2's shapes) on an AMD EPYC (Zen 5): at 1, 3 or 4
threads a GEMM of 1-3 rows takes another kernel than a bigger one; at 2 or 8 threads one of 1-3,
5-7 or 9-11 rows does too; from 12 rows up a row's bits never moved. On an Intel Xeon with AMX at
2 threads, 1-15 rows in the forward and, for the [1536, 576] weights, every count from 17 to 128
rows in the input gradient or the forward: no shared pass could keep a run's bits there. oneDNN's
GEMMs (engine/gemm.py), which a fp32 training pass runs for every LoRA-wrapped linear, moved a row
only alone (1 row) on both. A shared pass that took a 6-token op at 2 threads gave that run other
numbers than its op alone, silently; recovery's replay and "equals an uninterrupted run" rest on
those bits.

So before a model's first shared pass the engine asks, once per model and thread count, for every
distinct linear of the body (forward x W^T with its bias, and the input gradient dY W, through the
GEMMs the pass runs on it: oneDNN's for a wrapped fp32 linear, else torch's) and for the
head's tiles (x W_tile^T, and dY W_tile accumulated as the tiled head does, engine/head.py): which
row counts up to SCAN_ROWS, as a GEMM of their own and at an offset inside one, give other bits
than the same rows of a GEMM of BATCH_ROWS rows (the "odd" row counts). cotrain then shares a pass
only where no GEMM of it, and none of its ops' GEMMs alone, has an odd row count. A model with an
odd count beyond SCAN_ROWS / 2, or whose first 64 rows differ from the same rows of a bigger
batch, gets no shared pass (the pattern did not settle where probed). Either way each op gets its
bits alone; only throughput across tenants is lost, and the engine logs what decided it.

It is a probe, not a proof: row counts beyond SCAN_ROWS, and batches other than those tried, are
taken to behave like the big batch. ~1 s on SmolLM2-135M (the head's tile is most of
it); the cost grows with the layers' widths. On CUDA no shared pass keeps a run's bits (cuBLAS
rounds by the batch, tests/gpu) and none is promised there, so nothing is probed.
"""

from __future__ import annotations

import functools
import logging
from typing import TYPE_CHECKING, Callable

import torch

from tinkerd.engine import gemm, head

if TYPE_CHECKING:
    from tinkerd.engine.engine import ModelRuntime

log = logging.getLogger(__name__)

SCAN_ROWS = 32
BATCH_ROWS = head.ROW_BLOCK

Gemm = Callable[[torch.Tensor, torch.Tensor, "torch.Tensor | None"], torch.Tensor]


def _forward(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.nn.functional.linear(x, w, bias)


def _input_grad(dy: torch.Tensor, w: torch.Tensor, _bias: torch.Tensor | None) -> torch.Tensor:
    return torch.mm(dy, w)


# The fused LoRA node's and the head's GEMMs are engine/gemm.py's (oneDNN's where it is on: its
# `linear` is their forward); a linear without an adapter keeps torch's, so both are probed.
def _pass_input_grad(dy: torch.Tensor, w: torch.Tensor, _bias: torch.Tensor | None) -> torch.Tensor:
    return gemm.input_grad(dy, w)


def _head_input_grad(dy: torch.Tensor, w: torch.Tensor, _bias: torch.Tensor | None) -> torch.Tensor:
    # The tiled head's backward adds each tile's d @ W_tile into d hidden (HeadPass._block_backward).
    out = torch.empty(dy.shape[0], w.shape[1], dtype=dy.dtype)
    gemm.add_input_grad(out, dy, w, first=True)
    gemm.add_input_grad(out, dy, w, first=False)
    return out


def odd_rows(rt: "ModelRuntime") -> frozenset[int] | None:
    """The row counts (up to SCAN_ROWS) at which some GEMM a shared pass of `rt` spans gives a row
    other bits than inside a big batch, on this machine and thread count; None: no shared pass for
    this model here (module docstring). Empty on CUDA (nothing is promised there)."""
    if rt.precision.device != "cpu":
        return frozenset()
    odd: set[int] = set()
    for what, shape, dtype, bias, product, forward in _probes(rt):
        got = _odd(shape, dtype, bias, product, forward, torch.get_num_threads())
        if got is None:
            log.warning("shared training passes are off for %s: on this machine %s of a [%d, %d] %s weight gives "
                        "a row other bits in batches of different sizes; each of its ops runs in its own pass (the "
                        "same results, without the throughput across tenants)", rt.name, what, shape[0], shape[1],
                        str(dtype).removeprefix("torch."))
            return None
        odd |= got
    log.info("shared training passes of %s at %d threads avoid GEMMs of %s rows: there a row gets other bits "
             "than in a bigger batch", rt.name, torch.get_num_threads(), sorted(odd) or "no")
    return frozenset(odd)


def _probes(rt: "ModelRuntime") -> list[tuple[str, tuple[int, int], torch.dtype, bool, Gemm, bool]]:
    """(what, weight shape, dtype, has a bias, gemm, whether it is a forward) of every distinct GEMM
    a shared pass spans."""
    out_head = rt.model.get_output_embeddings()
    head_linear = getattr(out_head, "base", out_head)
    # A LoRA-wrapped fp32 linear trains through the fused node with or without adapters, whose GEMMs
    # are oneDNN's where it is on (lora/fused.py: fits): torch's never run on it in a shared pass. That
    # holds for its 3-D inputs; a wrapped linear with 2-D ones (a MoE's shared expert, its rows routed
    # per token) belongs to a family without shared passes (cotrain.SHARED_MOE).
    fused_only = {id(layer.base) for layer in rt.layers.values() if gemm.ours(layer.base.weight, layer.base.weight)}
    seen, probes = set(), []
    for module in rt.model.modules():
        if not isinstance(module, torch.nn.Linear) or module is head_linear:
            continue
        key = (tuple(module.weight.shape), module.weight.dtype, module.bias is not None)
        torch_path = id(module) not in fused_only
        if (key, torch_path) not in seen:
            seen.add((key, torch_path))
            if torch_path:
                probes.append(("the forward", *key, _forward, True))
                probes.append(("the input gradient", *key, _input_grad, False))
            if gemm.onednn():
                probes.append(("the fused node's forward", *key, gemm.linear, True))
                probes.append(("the fused node's input gradient", *key, _pass_input_grad, False))
    if isinstance(head_linear, torch.nn.Linear):
        vocab, hidden = head_linear.weight.shape
        for width in sorted({t.stop - t.start for t in head.tiles(vocab)}):
            key = ((width, hidden), head_linear.weight.dtype, False)
            probes.append(("the head's forward", *key, gemm.linear, True))
            probes.append(("the head's input gradient", *key, _head_input_grad, False))
    return probes


@functools.lru_cache(maxsize=256)
def _odd(shape: tuple[int, int], dtype: torch.dtype, bias: bool, product: Gemm, forward: bool,
         threads: int) -> frozenset[int] | None:
    """The row counts up to SCAN_ROWS whose rows, as a GEMM of their own or at an offset of one,
    get other bits than the same rows inside BATCH_ROWS; None if one is beyond SCAN_ROWS / 2 (the
    pattern has not settled), or if a batch of 64 rows differs. `threads` keys the cache: a BLAS
    splits a GEMM between threads by its size."""
    out_features, in_features = shape
    g = torch.Generator().manual_seed(0)
    w = torch.randn(shape, generator=g).div_(in_features ** 0.5).to(dtype)
    b = torch.randn(out_features, generator=g).to(dtype) if bias else None
    x = torch.randn(BATCH_ROWS, in_features if forward else out_features, generator=g).to(dtype)
    with torch.no_grad():
        whole = product(x, w, b)
        if not torch.equal(product(x[:64], w, b), whole[:64]):
            return None
        odd = set()
        for m in range(1, SCAN_ROWS + 1):
            at = (37 * m) % (BATCH_ROWS - m)  # offsets vary with m: a run's rows sit anywhere in a pass
            if not (torch.equal(product(x[:m], w, b), whole[:m]) and torch.equal(product(x[at:at + m], w, b), whole[at:at + m])):
                odd.add(m)
    return None if odd and max(odd) > SCAN_ROWS // 2 else frozenset(odd)
