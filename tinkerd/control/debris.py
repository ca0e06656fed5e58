"""Temp directories a crashed atomic write leaves next to checkpoints and recovery snapshots.

Every checkpoint, snapshot and copy is written into `.<name>.tmp-*` and renamed into place; an
existing one is first renamed aside to `.<name>.old-*/ckpt` (engine/checkpoints.py:
write_files_atomically, control/copies.py). A process killed mid-write leaves those behind: never
a half file under the real name, but disk space nobody frees. They are swept

- at server start and after every engine restart (Recovery.rebuild_engine, before the replay):
  then no engine write can be running, since the engine is fresh; a copy_weights in progress on the
  API side is skipped by name (`keep`);
- by the checkpoint sweeper, for temp dirs older than an hour (Runs.sweep_stale_temp);
- by `tinkerd fsck --repair` on a stopped server.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from pathlib import Path
from typing import Callable, Collection

log = logging.getLogger(__name__)

# Relative to checkpoints/: <model>/<segment>/.<name>.* for named checkpoints, _ephemeral/.<id>.* for samplers.
CHECKPOINT_TEMP = ("*/*/.*.tmp-*", "*/*/.*.old-*", "*/.*.tmp-*", "*/.*.old-*")
# Relative to snapshots/: <model_id>/.seq-<n>.tmp-* (engine/training.py: _snapshot).
SNAPSHOT_TEMP = ("*/.*.tmp-*", "*/.*.old-*")


def set_aside_target(d: Path) -> Path | None:
    """For `.<name>.old-*` holding `ckpt`: the real name it was set aside from; else None."""
    if ".old-" not in d.name or not (d / "ckpt").is_dir():
        return None
    return d.parent / d.name[1:].rsplit(".old-", 1)[0]


def sweep_temp(root: Path, patterns: Collection[str], older_than_s: float = 0.0,
               keep: Callable[[Path], bool] = lambda p: False) -> list[Path]:
    """Remove the temp dirs matching `patterns` under `root` whose mtime is older than
    `older_than_s` (0: all; only while no write can be running) and `keep` does not claim; returns
    them. A set-aside `.old-*` whose real name is empty (the crash came between the two renames)
    is put back first: its registration never changed."""
    if not root.is_dir():
        return []
    cutoff = time.time() - older_than_s
    handled = []
    for pattern in patterns:
        for d in root.glob(pattern):
            try:
                if not d.is_dir() or (older_than_s > 0 and d.stat().st_mtime >= cutoff) or keep(d):
                    continue
                target = set_aside_target(d)
                if target is not None and not target.exists():
                    os.replace(d / "ckpt", target)
                    log.warning("restored %s, set aside by a write that crashed before replacing it", target)
                shutil.rmtree(d, ignore_errors=True)
                handled.append(d)
            except FileNotFoundError:  # swept meanwhile by another sweep
                pass
    return handled
