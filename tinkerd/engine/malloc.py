"""Keep freed memory in the engine's process instead of handing it back to the OS after every op.

A training step allocates and frees tens of MB of temporaries (activations, head chunks, grads).
glibc's malloc serves large blocks with mmap, returns them (and the top of its heap) to the OS on
free, and moves its mmap threshold with the history of frees; so the next step takes the same
memory back one zero-filled page at a time, some runs more than others. Measured with
`python benchmarks/engine_malloc.py` (tiny model, 1 thread, engine alone in a spawned process):
18.3k minor page faults and 366 ms CPU per step by default, 250 faults and 332 ms tuned (-9%). The
server benchmark saw 19-26k faults per step in the engine process against 1-19k with the engine on
a server thread, which explains part of the process engine's measured overhead. Tuned, the
engine's memory stays at its peak working set, which every step needs again anyway.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import logging
import os
from collections.abc import Iterator, Mapping

log = logging.getLogger(__name__)

# mallopt parameters (glibc malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_M_MMAP_MAX = -4
# Blocks up to this size come from the heap (glibc's ceiling for the threshold on 64-bit: 32 MB).
MMAP_THRESHOLD_BYTES = 32 << 20
# Free memory at the top of the heap is returned to the OS only beyond this.
TRIM_THRESHOLD_BYTES = 1 << 30


# glibc (>= 2.35) tunable: malloc asks for transparent huge pages (madvise) on the memory it maps.
# It is read once at process start, so it is set in the environment of a process about to start.
HUGE_PAGES_TUNABLE = "glibc.malloc.hugetlb=1"


def with_huge_pages(env: Mapping[str, str]) -> dict[str, str]:
    """env with malloc's huge-page tunable added to GLIBC_TUNABLES (kept as is if it sets one).

    Decode streams every weight once per step; with 4 KB pages a oneDNN GEMM of 8 rows read them at
    13.2 GB/s on SmolLM2's gate/up shape (1 thread), with 2 MB pages at 15.3 (a plain sum: 21.6 ->
    33.6 GB/s), and the whole batch-8 decode ran 5% faster. C libraries other than glibc ignore it.
    """
    current = env.get("GLIBC_TUNABLES", "")
    if "glibc.malloc.hugetlb" in current:
        return dict(env)
    return {**env, "GLIBC_TUNABLES": f"{current}:{HUGE_PAGES_TUNABLE}" if current else HUGE_PAGES_TUNABLE}


@contextlib.contextmanager
def children_use_huge_pages() -> Iterator[None]:
    """Processes started inside this block (multiprocessing spawn inherits os.environ) get the tunable."""
    before = os.environ.get("GLIBC_TUNABLES")
    os.environ["GLIBC_TUNABLES"] = with_huge_pages(os.environ)["GLIBC_TUNABLES"]
    try:
        yield
    finally:
        if before is None:
            del os.environ["GLIBC_TUNABLES"]
        else:
            os.environ["GLIBC_TUNABLES"] = before


def keep_freed_memory(map_large: bool = True) -> bool:
    """Tune glibc malloc for the engine (call once, early); False where the C library is not glibc.

    glibc will not serve a block over 32 MB from its heap by threshold alone, so such blocks are still
    mapped and unmapped on every use. `map_large=False` turns mapping off (M_MMAP_MAX 0): every block
    then comes from the heap. The HF + PEFT baseline of benchmarks/training.py takes it, since its
    loss makes [tokens, vocabulary] logits (100 MB at 2 x 256 tokens on SmolLM2): there its step went
    ~2.2 -> ~1.75 s at 2 threads (2,240 minor faults and ~0.8 s of system time a step -> ~0), on a
    2-core Xeon. The engine keeps mapping them. Off, a 4 x 2048-token SmolLM2 step ran 43.5 -> 36.2 s
    (2 threads), but the heap can then grow without bound: posix_memalign, which torch allocates
    with, asks for a block's size plus its alignment, so a freed block never fits the next block of
    its size, and with a live allocation above each one the heap grew 200 MB an iteration of
    allocating and freeing one 200 MB tensor (docs/architecture.md section 9, session 43)."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):  # not glibc (macOS, musl): its allocator is left alone
        return False
    ok = mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) == 1 and mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES) == 1
    if not map_large:
        ok = mallopt(_M_MMAP_MAX, 0) == 1 and ok
    if not ok:
        log.warning("could not tune malloc for the engine; steps may spend ~10%% in page faults")
    return ok
