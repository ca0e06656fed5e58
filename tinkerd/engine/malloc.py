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

import ctypes
import ctypes.util
import logging

log = logging.getLogger(__name__)

# mallopt parameters (glibc malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
# Blocks up to this size come from the heap (glibc's ceiling for the threshold on 64-bit: 32 MB).
MMAP_THRESHOLD_BYTES = 32 << 20
# Free memory at the top of the heap is returned to the OS only beyond this.
TRIM_THRESHOLD_BYTES = 1 << 30


def keep_freed_memory() -> bool:
    """Tune glibc malloc for the engine (call once, early); False where the C library is not glibc."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):  # not glibc (macOS, musl): its allocator is left alone
        return False
    ok = mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) == 1 and mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES) == 1
    if not ok:
        log.warning("could not tune malloc for the engine; steps may spend ~10%% in page faults")
    return ok
