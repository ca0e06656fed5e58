"""Which CPU kernels the engine takes where torch offers two, decided once from the CPU's features.

Several choices of the engine were measured on one CPU and do not carry to another, because the
libraries pick their kernels by vendor and features:

- MKL (torch's fp32 sgemm, and the inner products of its CPU flash-attention kernel) takes its
  AVX-512 kernels on Intel CPUs only; on AMD it runs AVX2 even where the core has full-width AVX-512
  (Zen 5). oneDNN picks its kernels by the features on either.
- AMX (Intel Xeon, Sapphire Rapids on) runs bf16 GEMMs ~6x the fp32 rate, and torch's bf16 flash
  attention on CPU uses it.

So, measured on SmolLM2-135M, 2 x 256 tokens, rank 32, a forward_backward + optim_step in process,
alternating (ms, 2 threads unless said):

| choice | AMD EPYC Zen 5 | Intel Xeon with AMX |
|---|---|---|
| fp32 attention: GEMM blocks (causal_gemm) vs flash blocks (causal) | GEMM blocks 1.2-1.9x faster per layer | flash blocks: step 1.066x (1 thread 1.050x) |
| bf16 attention: GEMM blocks in fp32 vs the bf16 flash kernel (HF's SDPA) | GEMM blocks 1.4x faster per layer | flash kernel: step 1.150x (1 thread 1.078x) |
| the LoRA products from 256 rows (head: 64): oneDNN vs MKL | oneDNN 1.2-2x faster | MKL: step 1.047x (1 thread 1.037x); head 1.01x |
| fp32 attention without a mask from 1536 tokens: flash blocks vs the kernel's one call | blocks (1 thread, 2 x 2048: 529 -> 500 ms a layer) | one call: 1 x 2048 a layer 1.24x (1 thread 1.17x) |
| fp32 flash blocks from 1024 tokens: T/16 vs 256 queries | T/16 | 256: 1 x 1024 a layer 1.14x, 2 x 2048 padded 1.11x |
| bf16 attention of right-padded rows wider than 512 tokens: the kernel's masked call vs each row alone unmasked | GEMM blocks (above) | row by row: a step of 2048 + 1900 tokens 1.21x (1 thread 1.35x), of 500-600 1.11x |
| the sampler's fp32 base weights packed for oneDNN's 1x1 convolution vs its inner product (lora/layers.py) | convolution (Zen 4, 1 thread, 8 rows: the body's linears 25 against 28 ms) | inner product (`benchmarks/packing.py`, its time over the convolution's, 2 threads: the body 0.95x at 1 row, 0.87x at 32, 0.79x at a 128-row prefill chunk; 1 thread 0.94x, 0.92x, 0.74x): GRPO-shaped sampling through the SDK 1.07x |

`mkl_avx512` and `amx` say which column a machine is in. They read the CPU's vendor and features,
never a timing, so a replay after a crash on the same machine takes the kernels the first run took
and gets its bits (recovery's "equals an uninterrupted run"). Each choice moves a result only in its
last bits (a different summation order), and each op takes the same kernels alone and in a shared
pass (engine/cotrain.py), so a run's bits there hold on either column.
"""

from __future__ import annotations

import functools

import torch


@functools.cache
def vendor() -> str:
    """The CPU's vendor string (GenuineIntel, AuthenticAMD), '' where /proc/cpuinfo does not say."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("vendor_id"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


@functools.cache
def mkl_avx512() -> bool:
    """Whether MKL runs its AVX-512 kernels here: an Intel CPU with AVX-512."""
    return vendor() == "GenuineIntel" and bool(getattr(torch.cpu, "_is_avx512_supported", lambda: False)())


@functools.cache
def amx() -> bool:
    """Whether the CPU has AMX tiles, which torch's bf16 GEMMs and bf16 flash attention use."""
    return bool(getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)())


def gemm_attention(dtype: torch.dtype) -> bool:
    """Whether a training pass's causal attention of this dtype runs as oneDNN GEMM blocks
    (engine/causal_gemm.py) rather than torch's flash kernel (engine/causal.py: fp32 in query blocks,
    bf16 in HF's one SDPA call): the table above."""
    return not (amx() if dtype == torch.bfloat16 else mkl_avx512())
