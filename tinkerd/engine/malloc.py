"""Keep freed memory in the engine's process instead of handing it back to the OS after every op.

A training step allocates and frees tens of MB of temporaries (activations, head chunks, grads).
glibc's malloc serves large blocks with mmap, returns them (and the top of its heap) to the OS on
free, and moves its mmap threshold with the history of frees; so the next step takes the same
memory back one zero-filled page at a time, some runs more than others. Measured with
`python benchmarks/engine_malloc.py` (tiny model, 1 thread, engine alone in a spawned process):
18.3k minor page faults and 366 ms CPU per step by default, 250 faults and 332 ms tuned (-9%). The
server benchmark saw 19-26k faults per step in the engine process against 1-19k with the engine on
a server thread, which explains part of the process engine's measured overhead. Tuned, the
engine's memory stays at its peak working set, which every step needs again anyway, until the
machine runs short of memory or the engine idles (`HeapWatcher`).
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import logging
import os
import threading
import time
from collections.abc import Iterator, Mapping
from pathlib import Path

log = logging.getLogger(__name__)

# mallopt parameters (glibc malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_M_MMAP_MAX = -4
# Blocks up to this size come from the heap (glibc's ceiling for the threshold on 64-bit: 32 MB).
MMAP_THRESHOLD_BYTES = 32 << 20
# Free memory at the top of the heap is returned to the OS only beyond this.
TRIM_THRESHOLD_BYTES = 1 << 30
# Below this share of memory left, the heap's free pages go back to the OS (HeapWatcher).
LOW_MEMORY_FRACTION = 0.10
# The HeapWatcher looks this often, gives free pages back after this long without work, and
# at least this often. Idle means a pause of the user's loop as often as an abandoned server: an RL
# loop that scores its samples for more than IDLE_S between ops pays the next step's faults every
# time, and on a VM whose host takes freed guest memory back those cost far more than the
# page-zeroing: a GRPO-shaped forward_backward through the SDK (SmolLM2, 4 prompts x 256 tokens,
# 8 samples of 64, 2 threads, a 7.5 GB engine) took 22.0 s after a 35 s pause with a 30 s IDLE_S
# against 10.6-11.5 s without the give-back (the first step of a fresh engine, 22.3 s, is the same
# cost). Memory running short gives pages back at the next look whatever IDLE_S says.
CHECK_S = 1.0
IDLE_S = 300.0
REFRESH_S = 600.0
_watching = threading.Lock()  # held once this process's HeapWatcher runs


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


def keep_freed_memory() -> bool:
    """Tune glibc malloc for the engine (call once, early); False where the C library is not glibc.

    Freed blocks stay in the heap for the next step: the mmap threshold at its 32 MB ceiling, the
    heap's top trimmed only past 1 GB, and no block mapped at all (M_MMAP_MAX 0), since glibc maps
    every block over 32 MB by size alone, and unmaps it on free, so the next step faulted it in and
    zeroed it again. Such blocks are a wide batch's activations (SmolLM2's MLP at 8 x 1024 tokens:
    50 MB each; an 8B model's from ~700 tokens in fp32) or an HF loss's [tokens, vocabulary] logits. At 8 x
    1024 tokens, 2 threads, on a 2-core Xeon (`benchmarks/engine_malloc.py`, rank 8): a step 36.8 s
    with 8.8 s of system time mapped, 32.1 s with 0.2 s kept, the same peak RSS (docs/architecture.md
    section 9, session 44). What the heap then holds is bounded by a `HeapWatcher`, started here."""
    libc = _libc()
    if libc is None:  # not glibc (macOS, musl): its allocator is left alone
        return False
    ok = (libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) == 1
          and libc.mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES) == 1
          and libc.mallopt(_M_MMAP_MAX, 0) == 1)
    if not ok:
        log.warning("could not tune malloc for the engine; steps may spend ~10%% in page faults")
    elif _watching.acquire(blocking=False):  # one watcher a process, however often this is called
        HeapWatcher().start()
    return ok


def give_back() -> bool:
    """Hand every free page of the heap back to the OS (malloc_trim); True if any went back."""
    libc = _libc()
    return libc is not None and libc.malloc_trim(0) == 1


class HeapWatcher:
    """Gives the heap's free pages back to the OS now and then, and when memory runs short.

    With no block mapped, the heap keeps what the widest step freed (its peak working set, which
    the next such step takes again), and with steps of many shapes it grows past that, as freed
    blocks of one size are split for others: 24 SmolLM2 steps of 4 shapes of 5.4-8k tokens (2
    threads) grew it from 11.0 to 15.1 GB without levelling off, where one shape stayed at 9-10 GB
    (session 44); the engine grew alike before, when such blocks were mapped (those steps' length
    buckets keep theirs under 32 MB). One that trained a wide batch also held it while idle. So a thread
    looks every `check_s` and hands every free page back (`give_back`): at every look while less
    than `low` of the machine's memory, or of this process's cgroup limit, is left (`memory_left`);
    once the process has done no work (under 5% of a core) for `idle_s`; and `refresh_s` after the
    last time, so what the heap holds beyond a step's working set never builds up for longer. The
    next step then faults in what it needs, as every step did with large blocks mapped (rank 32, 2
    threads: 2 x 256 tokens 1.76 -> 1.90 s, 8 x 1024 34.4 -> 39.3 s; once in 10 minutes, under 1%).
    A look costs ~50 us."""

    def __init__(self, check_s: float | None = None, idle_s: float | None = None, refresh_s: float | None = None,
                 low: float | None = None, left=None, cpu=time.process_time, clock=time.monotonic, trim=give_back):
        self.check_s = CHECK_S if check_s is None else check_s
        self.idle_s = IDLE_S if idle_s is None else idle_s
        self.refresh_s = REFRESH_S if refresh_s is None else refresh_s
        self.low = LOW_MEMORY_FRACTION if low is None else low
        self._left, self._cpu, self._clock, self._trim = left or memory_left, cpu, clock, trim
        self._last = (clock(), cpu())
        self._busy_at = self._trimmed_at = self._last[0]
        self._idle_trimmed = False
        self._said_short = False

    def start(self) -> None:
        threading.Thread(target=self._run, name="tinkerd-heap-watcher", daemon=True).start()

    def _run(self) -> None:
        while True:
            time.sleep(self.check_s)
            self.check()

    def check(self) -> str | None:
        """One look: why the free pages went back ('short', 'idle', 'refresh'), or None."""
        now, cpu = self._clock(), self._cpu()
        if cpu - self._last[1] > 0.05 * (now - self._last[0]):
            self._busy_at, self._idle_trimmed = now, False
        self._last = (now, cpu)
        left = self._left()
        if left is not None and left < self.low:
            # Said once: while memory stays short, this runs at every look.
            log.log(logging.DEBUG if self._said_short else logging.INFO, "memory short (%.0f%% left): the engine's "
                    "free heap pages go back to the OS while it lasts", 100 * left)
            self._said_short = True
            why = "short"
        elif not self._idle_trimmed and now - self._busy_at >= self.idle_s:
            self._idle_trimmed = True  # once per idle spell: nothing is freed while idle
            why = "idle"
        elif now - self._trimmed_at >= self.refresh_s:
            why = "refresh"
        else:
            return None
        self._trim()
        self._trimmed_at = now
        return why


def memory_left(proc: str = "/proc", cgroup: str = "/sys/fs/cgroup") -> float | None:
    """The share of memory still available: the machine's (MemAvailable / MemTotal) or, where this
    process's cgroup or one above it (v2, or v1's memory controller) has a lower limit, the limit's
    less that cgroup's anonymous memory (page cache is reclaimable); the lowest. None if unknown."""
    room = _room(proc, cgroup)
    return None if room is None else room[0]


def bytes_left(proc: str = "/proc", cgroup: str = "/sys/fs/cgroup") -> int | None:
    """Bytes still available: what `memory_left` counts, in bytes (the lowest of the machine's and
    its cgroups'). The free blocks the process's own heap keeps are not among them. None if unknown."""
    room = _room(proc, cgroup)
    return None if room is None else room[1]


def _room(proc: str, cgroup: str) -> tuple[float, int] | None:
    """(share, bytes) of memory left, the lower of the machine's and this process's cgroup's."""
    try:
        info = dict(line.split(":", 1) for line in Path(proc, "meminfo").read_text().splitlines() if ":" in line)
        total = int(info["MemTotal"].split()[0]) * 1024
        available = int(info["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return None
    share, left = available / total, available
    for limit_path, stat_path, anon_key in _cgroup_files(proc, cgroup):
        try:
            limit = limit_path.read_text().strip()
            if limit == "max" or int(limit) >= total:
                continue
            stat = dict(line.split() for line in stat_path.read_text().splitlines())
            room = int(limit) - int(stat[anon_key])
            share, left = min(share, room / int(limit)), min(left, room)
        except (OSError, KeyError, ValueError):
            continue
    return share, max(0, left)


def _cgroup_files(proc: str, cgroup: str) -> list[tuple[Path, Path, str]]:
    """(limit file, stat file, its anonymous-memory key) of each memory cgroup whose limit binds this
    process: its own (v2, or v1's memory controller, by /proc/self/cgroup) and every ancestor's. A
    container sees its own as the root; a systemd unit's MemoryMax= or a test's cgroup is a subdirectory."""
    try:
        lines = Path(proc, "self", "cgroup").read_text().splitlines()
    except OSError:
        lines = []
    fields = [line.split(":", 2) for line in lines if line.count(":") >= 2]
    v2 = next((path for hid, _, path in fields if hid == "0"), "/")
    v1 = next((path for _, controllers, path in fields if "memory" in controllers.split(",")), "/")
    out = []
    for root, own, (limit, stat, anon) in ((Path(cgroup), v2, ("memory.max", "memory.stat", "anon")),
                                           (Path(cgroup, "memory"), v1, ("memory.limit_in_bytes", "memory.stat", "total_rss"))):
        parts = [p for p in own.split("/") if p]
        for k in range(len(parts), -1, -1):
            where = root.joinpath(*parts[:k])
            out.append((where / limit, where / stat, anon))
    return out


@functools.cache
def _libc():
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        libc.mallopt, libc.malloc_trim  # glibc's
    except (OSError, AttributeError, TypeError):
        return None
    return libc
