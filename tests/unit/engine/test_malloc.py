"""engine/malloc.py: the engine's heap keeps freed blocks of any size while it works, and gives their
pages back when it idles or memory runs short.

The probes run in a fresh interpreter each (mallopt settings are the process's). mallinfo2's
hblkhd is the bytes in mapped blocks; /proc/self/statm's second field the resident pages.
"""

from __future__ import annotations

import ctypes.util
import os
import subprocess
import sys

import pytest

from tinkerd.engine import malloc

_PROBE = """
import ctypes, os, sys, time
import torch
from tinkerd.engine import malloc

class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in
                "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]

libc = ctypes.CDLL(ctypes.util.find_library("c"))
libc.mallinfo2.restype = MallInfo2

def rss():
    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

mode = sys.argv[1]
malloc.LOW_MEMORY_FRACTION = 0.0  # whatever this machine has left: only idleness gives pages back here
malloc.CHECK_S, malloc.IDLE_S = 0.05, 0.5
if mode != "default":
    assert malloc.keep_freed_memory()
before = libc.mallinfo2().hblkhd  # blocks mapped while torch was imported
x = torch.ones(150_000_000)  # 600 MB: past glibc's 32 MB ceiling for heap blocks, under the 1 GB top trim
mapped = libc.mallinfo2().hblkhd - before
above = torch.ones(1000)  # a live block above it: the heap's top cannot shrink past it
del x
kept = rss()
end = time.monotonic() + 2.0
if mode == "busy":
    while time.monotonic() < end:  # working: the watcher keeps the pages for the next step
        pass
else:
    time.sleep(2.0)  # idle for 4 watcher periods of 0.5 s
print(mapped, kept, rss())
"""


def _probe(mode: str) -> tuple[int, int, int]:
    env = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
    out = subprocess.run([sys.executable, "-c", _PROBE, mode], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    mapped, kept, after = out.stdout.split()[-3:]
    return int(mapped), int(kept), int(after)


def _has_mallinfo2() -> bool:
    name = ctypes.util.find_library("c")
    try:
        return name is not None and hasattr(ctypes.CDLL(name), "mallinfo2")
    except OSError:
        return False


glibc_only = pytest.mark.skipif(not _has_mallinfo2(), reason="glibc >= 2.33 only (mallinfo2)")


@glibc_only
def test_a_big_freed_block_stays_resident_while_the_engine_works():
    mapped, kept, after = _probe("busy")
    assert mapped < 1_000_000  # from the heap, not mapped
    assert after > kept - 50_000_000  # freed, it stays for the next step


@glibc_only
def test_an_idle_engine_gives_its_free_pages_back():
    mapped, kept, after = _probe("idle")
    assert mapped < 1_000_000 and kept > 600_000_000
    assert after < kept - 500_000_000


@glibc_only
def test_untuned_glibc_maps_a_big_block():
    mapped, kept, _ = _probe("default")
    assert mapped >= 600_000_000  # glibc's own setting: mapped, unmapped on free, faulted in anew each time


class _Clock:
    def __init__(self):
        self.now, self.cpu, self.left = 0.0, 0.0, 0.5

    def tick(self, busy: bool) -> None:
        self.now += 1.0
        self.cpu += 0.5 if busy else 0.01  # 50% of a core, or the watcher's own crumbs


def _watcher(clock: _Clock, trims: list, refresh_s: float = 100.0) -> malloc.HeapWatcher:
    return malloc.HeapWatcher(check_s=1.0, idle_s=3.0, refresh_s=refresh_s, low=0.1, left=lambda: clock.left,
                              cpu=lambda: clock.cpu, clock=lambda: clock.now, trim=lambda: trims.append(clock.now))


def test_the_watcher_gives_back_once_per_idle_spell():
    clock, trims = _Clock(), []
    watcher = _watcher(clock, trims)
    seen = []
    for busy in [True] * 5 + [False] * 6 + [True] * 2 + [False] * 4:
        clock.tick(busy)
        seen.append(watcher.check())
    assert seen == [None] * 7 + ["idle"] + [None] * 3 + [None] * 2 + [None] * 2 + ["idle"] + [None]
    assert trims == [8.0, 16.0]


def test_the_watcher_gives_back_at_every_look_while_memory_is_short_even_when_busy():
    clock, trims = _Clock(), []
    watcher = _watcher(clock, trims)
    clock.tick(True)
    assert watcher.check() is None
    clock.left = 0.05
    for _ in range(3):
        clock.tick(True)
        assert watcher.check() == "short"
    clock.left = None  # unknown: nothing to go by
    clock.tick(True)
    assert watcher.check() is None
    assert trims == [2.0, 3.0, 4.0]


def _proc(tmp_path, total_kb: int, available_kb: int):
    (tmp_path / "proc").mkdir()
    (tmp_path / "proc" / "meminfo").write_text(
        f"MemTotal:       {total_kb} kB\nMemFree:        1 kB\nMemAvailable:   {available_kb} kB\n")
    return tmp_path / "proc"


def test_memory_left_is_the_machines_share_available(tmp_path):
    proc = _proc(tmp_path, 1000, 250)
    assert malloc.memory_left(proc, tmp_path / "no-cgroup") == pytest.approx(0.25)
    assert malloc.memory_left(tmp_path / "nowhere", tmp_path / "no-cgroup") is None


def test_memory_left_takes_a_tighter_cgroup_limit_less_its_anonymous_memory(tmp_path):
    proc = _proc(tmp_path, 1000, 900)  # the machine: 90% left
    v2 = tmp_path / "v2"
    v2.mkdir()
    (v2 / "memory.max").write_text(f"{400 * 1024}\n")  # 400 kB of the machine's 1000
    (v2 / "memory.stat").write_text(f"anon {300 * 1024}\nfile {90 * 1024}\n")  # page cache does not count
    assert malloc.memory_left(proc, v2) == pytest.approx(0.25)
    (v2 / "memory.max").write_text("max\n")  # no limit: the machine's
    assert malloc.memory_left(proc, v2) == pytest.approx(0.9)
    v1 = tmp_path / "v1" / "memory"
    v1.mkdir(parents=True)
    (v1 / "memory.limit_in_bytes").write_text("9223372036854771712\n")  # v1's "no limit"
    (v1 / "memory.stat").write_text(f"rss 1\ntotal_rss {380 * 1024}\n")
    assert malloc.memory_left(proc, v1.parent) == pytest.approx(0.9)
    (v1 / "memory.limit_in_bytes").write_text(f"{400 * 1024}\n")
    assert malloc.memory_left(proc, v1.parent) == pytest.approx(0.05)


def test_the_limit_of_the_cgroup_the_process_is_in_or_above_it_counts(tmp_path):
    """A systemd unit's MemoryMax= or a test's cgroup is a subdirectory of the hierarchy, named in
    /proc/self/cgroup; a limit on it or on any cgroup above it binds the process. bytes_left: the
    same room in bytes."""
    proc = _proc(tmp_path, 1000, 900)
    (proc / "self").mkdir()
    (proc / "self" / "cgroup").write_text("4:memory:/svc/unit\n0::/svc/unit\n")
    v2 = tmp_path / "v2"
    (v2 / "svc" / "unit").mkdir(parents=True)
    (v2 / "memory.max").write_text("max\n")
    (v2 / "svc" / "unit" / "memory.max").write_text("max\n")
    (v2 / "svc" / "unit" / "memory.stat").write_text(f"anon {100 * 1024}\n")
    assert malloc.memory_left(proc, v2) == pytest.approx(0.9)
    (v2 / "svc" / "memory.max").write_text(f"{500 * 1024}\n")  # the parent's limit, over its subtree's anon
    (v2 / "svc" / "memory.stat").write_text(f"anon {400 * 1024}\n")
    assert malloc.memory_left(proc, v2) == pytest.approx(0.2)
    assert malloc.bytes_left(proc, v2) == 100 * 1024
    v1 = tmp_path / "v1" / "memory" / "svc" / "unit"
    v1.mkdir(parents=True)
    (v1 / "memory.limit_in_bytes").write_text(f"{200 * 1024}\n")
    (v1 / "memory.stat").write_text(f"total_rss {50 * 1024}\n")
    assert malloc.memory_left(proc, v1.parents[2]) == pytest.approx(0.75)
    assert malloc.bytes_left(proc, tmp_path / "v1") == 150 * 1024


def test_the_watcher_gives_back_every_refresh_period_while_busy():
    # What the heap holds past a step's working set (blocks split for other shapes) never builds up longer.
    clock, trims = _Clock(), []
    watcher = _watcher(clock, trims, refresh_s=5.0)
    seen = []
    for _ in range(12):
        clock.tick(True)
        seen.append(watcher.check())
    assert trims == [5.0, 10.0]
    assert seen.count("refresh") == 2 and seen.count(None) == 10
