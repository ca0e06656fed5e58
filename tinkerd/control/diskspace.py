"""The free-space reserve of the data directory: below it, new work is refused before it is accepted.

Everything tinkerd writes lands in one directory: the store (every accepted op, its result, usage),
checkpoints, recovery snapshots and exports. An op that was accepted must be able to finish: its
result row, its usage row and, for saves, its files. So new work (a new session, a submitted op)
is refused while the free space is under a reserve, with errors.StorageUnavailable (503 +
Retry-After, which the SDK retries as it waits for capacity), and what was accepted spends the
reserve.

The default reserve is min(1 GiB, 5% of the filesystem). 1 GiB holds ~8 rank-32 SmolLM2 saves or
snapshots with AdamW state (~120 MB each: a snapshot per active run plus the saves in flight) and
millions of result rows; the 5% cap keeps a small disk usable (a 16 GB VM keeps 800 MB, a 64 MB
test tmpfs 3.2 MB). `--min-free-disk-gb` replaces it; 0 turns the check off.

The state is read with one statvfs per check (~2 us), so it is exact on every request. The log
says once when the reserve is reached and once when space is back, never per request.
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass
from pathlib import Path

from tinkerd.errors import StorageUnavailable

log = logging.getLogger(__name__)

GIB = 2**30
DEFAULT_RESERVE_BYTES = GIB
DEFAULT_RESERVE_FRACTION = 0.05


@dataclass(frozen=True)
class DiskState:
    path: str
    free_bytes: int
    total_bytes: int
    reserve_bytes: int

    @property
    def ok(self) -> bool:
        return self.free_bytes >= self.reserve_bytes

    def as_dict(self) -> dict:
        return {"path": self.path, "free_bytes": self.free_bytes, "total_bytes": self.total_bytes,
                "reserve_bytes": self.reserve_bytes, "ok": self.ok}


def human(n: int) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} bytes"


class DiskReserve:
    def __init__(self, path: Path, reserve_bytes: int | None = None):
        self.path = Path(path)
        # None: the default, resolved per filesystem size (see the module docstring).
        self._reserve_bytes = reserve_bytes
        self._low = False
        self._lock = threading.Lock()

    def state(self) -> DiskState:
        st = os.statvfs(self.path)
        total = st.f_blocks * st.f_frsize
        reserve = self._reserve_bytes
        if reserve is None:
            reserve = min(DEFAULT_RESERVE_BYTES, int(total * DEFAULT_RESERVE_FRACTION))
        state = DiskState(str(self.path), st.f_bavail * st.f_frsize, total, reserve)
        self._note(state)
        return state

    def check(self) -> None:
        """Raise StorageUnavailable when new work must not be accepted."""
        state = self.state()
        if not state.ok:
            raise StorageUnavailable(
                f"server storage is full: {human(state.free_bytes)} free on {state.path}, under the "
                f"{human(state.reserve_bytes)} reserve kept for work already accepted; new work is refused "
                f"until space is freed")

    def _note(self, state: DiskState) -> None:
        with self._lock:
            if state.ok == (not self._low):
                return
            self._low = not state.ok
        if self._low:
            log.error("data directory %s is under its free-space reserve: %s free of %s, reserve %s; new "
                      "sessions and ops are refused (503) until space is freed, accepted ones finish",
                      state.path, human(state.free_bytes), human(state.total_bytes), human(state.reserve_bytes))
        else:
            log.warning("data directory %s has room again: %s free, reserve %s; accepting new work",
                        state.path, human(state.free_bytes), human(state.reserve_bytes))
