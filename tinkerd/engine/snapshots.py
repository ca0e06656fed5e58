"""Recovery snapshots (control/recovery.py), written off the training step's critical path.

A snapshot after an optim_step is ~120 MB for a rank-32 SmolLM2 adapter with its AdamW state:
serialising and fsyncing it took 0.5-1.4 s of the step on a loaded 2-core machine, more than the
optimizer update itself. The step serialises the state into memory (safetensors, torch.save,
straight from the live tensors: together ~80 ms for that adapter on a 2-core Xeon, once per
snapshot interval; optimizer.pt without the zip's CRC-32s, which took a third of it:
checkpoints._without_crc32); a single background thread writes the files through the
ArtifactStore (temp dir, fsync, rename: visible whole or not at all) and then drops the older snapshots beside it. The op's
result goes back meanwhile.

Why the serialising is not in the background too: both serialisers hold the GIL for tens of ms at a
time (a probe thread woke up to 15-21 ms late during them), and the training pass needs the GIL
between its kernels, the forward for every op and the backward for every Python autograd node (each
LoRA linear's, engine/lora/fused.py). Written beside the next step, a serialising snapshot made the
steps of a server with those nodes 4-6% slower on average (SmolLM2, 2 threads). The background
thread now only writes the files: os.write releases the GIL, and the copies into the O_DIRECT
buffer (tinkerd/artifacts.py) hold it for one 8 MB piece at a time.

Why recovery stays exact: the write-ahead log, not the snapshot, is the source of truth. Recovery
lists only whole artifacts and starts from the newest one whose op is stored as complete, then
replays the logged ops after it (control/recovery.py: latest_snapshot, replay_plan); a snapshot
still being written when the engine dies is a temp dir that the next start sweeps
(ArtifactStore.sweep_incomplete), and the one before it, kept until the new one is in place, is
used instead. Retention forgets op bodies only before a snapshot it can list (control/retention.py),
so the ops after the older snapshot are still there to replay.

What stays synchronous, and why:
- the snapshot after a load_weights (engine/training.py): once that op is complete, the user may
  delete the loaded checkpoint, and a replay of the load would then fail;
- the snapshot of a release (ReleaseAdaptersOp): the adapter is unloaded right after it, so its
  state must be on disk first.
Both wait for the write in flight first (`wait`), so writes of one store never overlap and the
older-snapshot cleanup runs in order. At most one write is in flight: a new one waits for the one
before, so the memory held is one adapter's serialised files.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

from tinkerd.artifacts import ArtifactStore
from tinkerd.engine import checkpoints
from tinkerd.engine.lora.pool import Adapter

log = logging.getLogger(__name__)

# Snapshots kept per run: the newest one's op result may not be stored yet when the process dies,
# and recovery then needs the one before.
KEEP = 2


def write(store: ArtifactStore, key: str, captured: checkpoints.Captured,
          staging: checkpoints.Staging | None = None) -> None:
    """Write one snapshot (artifact `key`, `.../<model_id>/seq-<n>`) and drop all but the KEEP newest."""
    put(store, key, captured.files(staging))


def put(store: ArtifactStore, key: str, files: dict) -> None:
    """Write a snapshot's serialised files as `key`; drop all but the KEEP newest beside it."""
    store.put(key, files)
    run = key.rsplit("/", 1)[0]
    for old in [k for k in store.list(run) if k.rsplit("/", 1)[1].startswith("seq-")][:-KEEP]:
        store.delete(old)


class SnapshotWriter:
    """The engine's one background writer of recovery snapshots (module docstring)."""

    def __init__(self, store: ArtifactStore):
        self.store = store
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tinkerd-snapshot")
        self._pending: Future | None = None
        # One serialisation buffer for every write: they never overlap (`wait` before each).
        self._staging = checkpoints.Staging()
        # Engine seconds the snapshots took since take_spent last ran: the copy in the step (wall),
        # the background write's CPU (its fsync waits cost the engine nothing), a synchronous write's
        # wall time. Control keeps it within --snapshot-budget (control/recovery.py).
        self._spent = 0.0
        self._lock = threading.Lock()

    def write_later(self, key: str, adapter: Adapter, base_model: str) -> None:
        """Serialise `adapter`'s weights and AdamW state now; write them as the snapshot `key` in the
        background. A write that fails is logged: recovery then starts from the snapshot before."""
        self.wait()  # the write in flight holds the staging buffer the files are serialised into
        started = time.perf_counter()
        files = checkpoints.capture(adapter, base_model, with_optimizer=True, copy=False).files(self._staging)
        self._spend(time.perf_counter() - started)
        self._pending = self._thread.submit(self._write_logged, key, files)

    def write_now(self, key: str, adapter: Adapter, base_model: str) -> None:
        """Write the snapshot `key` before returning; raises what the write raised."""
        self.wait()
        started = time.perf_counter()
        try:
            write(self.store, key, checkpoints.capture(adapter, base_model, with_optimizer=True, copy=False),
                  self._staging)
        finally:
            self._spend(time.perf_counter() - started)

    def take_spent(self) -> float:
        """Engine seconds spent on snapshots since the last call (StepOutput.snapshot_s)."""
        with self._lock:
            spent, self._spent = self._spent, 0.0
        return spent

    def _spend(self, seconds: float) -> None:
        with self._lock:
            self._spent += seconds

    def wait(self) -> None:
        """Return once the write in flight, if any, is done (or failed, and was logged)."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def close(self) -> None:
        self.wait()
        self._thread.shutdown(wait=True)

    def _write_logged(self, key: str, files: dict) -> None:
        started = time.thread_time()
        try:
            put(self.store, key, files)
        except Exception:
            log.exception("recovery snapshot %s failed", key)
        finally:
            self._spend(time.thread_time() - started)
