"""The frozen base weights' fp32 GEMMs of a training pass on a CPU: oneDNN's, not torch's default.

torch runs an fp32 `F.linear` or `mm` on a CPU through MKL's sgemm. On AMD CPUs MKL takes its AVX2
kernels even where the core has full-width AVX-512 (Zen 5), while oneDNN, which torch also ships
(the `mkldnn` ops), picks its kernels by the CPU's features. SmolLM2-135M's shapes, 512 rows, fp32,
AMD EPYC (Zen 5): MKL 111-119 GFLOP/s at 1 thread, oneDNN 250-270; 237 against 507 at 2 threads.
At 32 rows oneDNN is 1.5-2.3x, at 8 rows 0.95-2.5x. On an Intel Xeon (MKL's AVX-512 kernels) the two
ran the base GEMMs at 512 rows within a few percent of each other (the input gradient 0-12% slower
on oneDNN), but MKL's rounded a row by its batch from 17 rows at 2 threads where oneDNN's did not
(engine/rowbits.py), so oneDNN stays the base GEMMs' everywhere. Both are fp32 throughout (no bf16 or TF32
shortcut): against a float64 product their largest relative error was 3-7e-7 (MKL) and 4-12e-7
(oneDNN), the rounding of a different summation order.

So the base model's forward GEMMs and input-gradient GEMMs of a training pass (the fused LoRA node,
engine/lora/fused.py, and the tiled head, engine/head.py) call `linear` and `input_grad` here. They
run outside autograd (inside a custom Function, or under no_grad): the op has no derivative. The
fused node's rank-sized LoRA products come here only from LORA_MIN_ROWS rows of a part (`lora_mm`,
`lora_b_grad`); its in-place sums stay torch's. A row's output must not depend on the other rows
of its GEMM for a shared pass to give each run the bits it gets alone; engine/rowbits.py probes
these functions for that, as it probes torch's (oneDNN on the machine above: only a 1-row GEMM
rounds another way, against 1-3, 5-7 and 9-11 rows for MKL at 2 threads).

`TINKERD_CPU_GEMM=torch` in the engine's environment turns this off (torch's own path everywhere),
and it is off wherever oneDNN or the op is missing. The choice is made once per process, from the
build and the environment only (never from a timing), so a replay after a crash runs the GEMMs the
first run did and gets its bits.
"""

from __future__ import annotations

import functools
import logging
import os

import torch
import torch.nn.functional as F

from tinkerd.engine import cpu

log = logging.getLogger(__name__)

ENV = "TINKERD_CPU_GEMM"
_torch_linear = F.linear  # bound now: a caller may patch F.linear with something that calls back here


@functools.cache
def onednn() -> bool:
    """Whether fp32 CPU base GEMMs go through oneDNN in this process."""
    wanted = os.environ.get(ENV, "onednn")
    if wanted not in ("onednn", "torch"):
        raise ValueError(f"{ENV}={wanted!r}: expected 'onednn' or 'torch'")
    if wanted == "torch":
        return False
    if not torch.backends.mkldnn.is_available() or not hasattr(torch.ops.mkldnn, "_linear_pointwise"):
        log.info("oneDNN's linear is not available in this torch build: fp32 GEMMs go through torch's default")
        return False
    # One check that the private op (inductor's, not public API) still computes x W^T + b.
    gen = torch.Generator().manual_seed(0)
    x, w, b = torch.randn(5, 24, generator=gen), torch.randn(16, 24, generator=gen), torch.randn(16, generator=gen)
    d = torch.randn(5, 16, generator=gen)
    try:
        ok = torch.allclose(_linear(x, w, b), _torch_linear(x, w, b), rtol=1e-5, atol=1e-5) and torch.allclose(
            _linear(d, w.t(), None), d @ w, rtol=1e-5, atol=1e-5)
    except RuntimeError as e:
        log.warning("oneDNN's linear failed (%s): fp32 GEMMs go through torch's default", e)
        return False
    if not ok:
        log.warning("oneDNN's linear does not compute x W^T + b here: fp32 GEMMs go through torch's default")
    return ok


def _linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, w, bias, "none", [None], "")


def ours(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether x and W's fp32 CPU GEMMs outside autograd go through oneDNN here (`linear`, `input_grad`)."""
    return x.device.type == "cpu" and x.dtype == torch.float32 and w.dtype == torch.float32 and onednn()


def _ours(x: torch.Tensor, w: torch.Tensor) -> bool:
    return not (torch.is_grad_enabled() and (x.requires_grad or w.requires_grad)) and ours(x, w)


def linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., in] W^T + bias, W [out, in]: F.linear's result."""
    return _linear(x, w, bias) if _ours(x, w) else _torch_linear(x, w, bias)


def input_grad(d: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """d [..., out] W, W [out, in]: a linear's input gradient."""
    return _linear(d, w.t(), None) if _ours(d, w) else d.matmul(w)


# The fused node's rank-sized LoRA products gain from oneDNN only over many rows. SmolLM2's four
# products that write a fresh tensor (x A^T, d B and the two weight gradients), rank 32, all 30
# layers, ms MKL / oneDNN: 1 thread 8 rows 5.2 / 12.9, 32 rows 14.2 / 17.8, 128 rows 54 / 39,
# 256 rows 103 / 67, 512 rows 208 / 122; 2 threads 32 rows 10.0 / 16.6, 128 rows 30.1 / 30.3,
# 256 rows 58 / 49, 512 rows 112 / 85 (AMD EPYC Zen 5). On an Intel CPU MKL runs AVX-512 and was
# the faster at every size (Xeon with AMX, 2 threads, 512 rows, us per product MKL / oneDNN: x A^T
# 59 / 69, d^T u 88 / 112, the sum u B^T 78 / 108; a step 1.047x): there never (engine/cpu.py).
# A part's rows are the same alone and in a shared pass.
NEVER = 1 << 62
LORA_MIN_ROWS = NEVER if cpu.mkl_avx512() else 256


def lora_on_onednn(t: torch.Tensor, rows: int, min_rows: int | None = None) -> bool:
    """Whether a LoRA product of operand `t` over a part of `rows` rows goes through oneDNN here."""
    return rows >= (LORA_MIN_ROWS if min_rows is None else min_rows) and _ours(t, t)


def lora_mm(a: torch.Tensor, b: torch.Tensor, rows: int, min_rows: int | None = None) -> torch.Tensor:
    """a [M, K] b [K, N] for a LoRA product over a part of `rows` rows (either operand possibly a
    transposed view): through oneDNN from `min_rows` rows (default LORA_MIN_ROWS), else torch.mm."""
    return _linear(a, b.t(), None) if lora_on_onednn(a, rows, min_rows) and _ours(b, b) else torch.mm(a, b)


def lora_b_grad(d: torch.Tensor, u: torch.Tensor, rows: int) -> torch.Tensor:
    """d^T u [out, R] (d [M, out], u [M, R]): a LoRA B's gradient over a part of `rows` rows. oneDNN
    copies a transposed input operand (not a transposed weight), so from LORA_MIN_ROWS rows it is
    made as (u^T d)^T: the copy is u^T's R rows, not d^T's `out` (3 MB a call for SmolLM2's MLP)."""
    if lora_on_onednn(d, rows) and _ours(u, u):
        return _linear(u.t(), d.t(), None).t()
    return torch.mm(d.t(), u)


def add_lora(out: torch.Tensor, m1: torch.Tensor, m2: torch.Tensor, alpha: float, rows: int,
             min_rows: int | None = None) -> None:
    """out [M, N] += alpha * m1 [M, R] m2 [R, N]: a LoRA delta summed into a base output or input
    gradient over a part of `rows` rows. From LORA_MIN_ROWS rows oneDNN's product, then an in-place
    add; below, MKL's addmm_ (the sum inside the GEMM). SmolLM2, 2 x 256 tokens, rank 32, a step in
    process, 2 threads, three alternated pairs of processes: 1092 / 1109 / 1232 ms with addmm_
    everywhere against 1037 / 1079 / 1115 (alone, rank-32 sums into 512 x 576 and 512 x 1536:
    1.2-1.4x at 2 threads, 1.4-1.6x at 1); at 1 thread the step moved within its noise. The head's
    LoRA (engine/head.py) passes its own `min_rows`: its products span a 2048-column tile."""
    if lora_on_onednn(m1, rows, min_rows) and _ours(m2, m2):
        out.add_(_linear(m1, m2.t(), None), alpha=alpha)
    else:
        out.addmm_(m1, m2, alpha=alpha)


def add_input_grad(out: torch.Tensor, d: torch.Tensor, w: torch.Tensor, first: bool) -> None:
    """out [M, in] = d W (first) or += d W: the head's input gradient summed over its tiles."""
    if _ours(d, w):
        got = _linear(d, w.t(), None)
        out.copy_(got) if first else out.add_(got)
    elif first:
        torch.mm(d, w, out=out)
    else:
        out.addmm_(d, w)
