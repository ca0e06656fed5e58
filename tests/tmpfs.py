"""A small tmpfs for storage-fault tests: a real filesystem that fills up (ENOSPC from the kernel,
SQLite's "database or disk is full"), mounted for one test and unmounted after it.

Needs root (CI runs as root). Elsewhere the tests that use it are skipped, saying why.
"""

from __future__ import annotations

import os
import subprocess
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator


@contextmanager
def small_tmpfs(path: Path, size: str) -> Iterator[Path]:
    import pytest

    path.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0755", "tmpfs", str(path)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        yield path
    finally:
        # lazy: a process of the test still holding a file must not leave the mount behind.
        subprocess.run(["umount", "-l", str(path)], check=False)


def fill(path: Path, leave_bytes: int) -> int:
    """Write a ballast file at `path` until its filesystem has about `leave_bytes` free; its size."""
    st = os.statvfs(path.parent)
    free = st.f_bavail * st.f_frsize
    size = max(free - leave_bytes, 0)
    chunk = b"\0" * (1 << 20)
    written = 0
    with open(path, "wb") as f:
        try:
            while written < size:
                n = min(len(chunk), size - written)
                f.write(chunk[:n])
                written += n
            f.flush()
        except OSError:  # ENOSPC: full is what was asked for
            pass
    return written


def free_bytes(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize
