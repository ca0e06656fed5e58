"""engine/malloc.py: where a block past glibc's 32 MB heap ceiling comes from, with and without mapping.

In a fresh interpreter each (mallopt settings are the process's): a 100 MB tensor is mapped on its
own (mallinfo2's hblkhd, bytes in mapped blocks, grows by it) unless `keep_freed_memory(map_large=False)`, which
the HF + PEFT baseline of benchmarks/training.py takes for its 100 MB logits.
"""

from __future__ import annotations

import ctypes.util
import os
import subprocess
import sys

import pytest

_PROBE = """
import ctypes, sys
import torch
from tinkerd.engine.malloc import keep_freed_memory

class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in
                "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]

libc = ctypes.CDLL(ctypes.util.find_library("c"))
libc.mallinfo2.restype = MallInfo2
assert keep_freed_memory(map_large=sys.argv[1] == "map")
before = libc.mallinfo2().hblkhd  # blocks mapped while torch was imported
x = torch.ones(25_000_000)  # 100 MB
print(libc.mallinfo2().hblkhd - before)
"""


def _mapped_bytes(mode: str) -> int:
    env = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
    out = subprocess.run([sys.executable, "-c", _PROBE, mode], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    return int(out.stdout.split()[-1])


def _has_mallinfo2() -> bool:
    name = ctypes.util.find_library("c")
    try:
        return name is not None and hasattr(ctypes.CDLL(name), "mallinfo2")
    except OSError:
        return False


@pytest.mark.skipif(not _has_mallinfo2(), reason="glibc >= 2.33 only (mallinfo2)")
def test_a_block_past_the_heap_ceiling_is_mapped_unless_mapping_is_turned_off():
    assert _mapped_bytes("map") >= 100_000_000  # the engine's setting: mapped, and faulted in anew each time
    assert _mapped_bytes("heap") < 1_000_000  # the baseline's: from the heap, kept when freed
