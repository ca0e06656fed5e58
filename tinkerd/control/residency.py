"""Residency: which runs' adapters the engine holds, and releasing those of sessions that went away.

A training adapter holds an engine slot and memory (a rank-32 SmolLM2 adapter with its AdamW state
is ~135 MB) for as long as it is loaded, but a client can vanish without a word: a killed notebook,
a laptop gone to sleep. A session counts as gone once its last heartbeat (the SDK sends one every
10 s) is older than `expiry_s`. Each of its runs whose last request is older than that too, with
nothing queued or running, is then released: the engine writes the run's recovery snapshot, as of
its last create, load or optim_step, and unloads it. Sampler adapters that only gone sessions use
are dropped from memory; their files stay.

Nothing is lost. A released run's state is its snapshot plus the logged forward_backward calls
after it, which is exactly what crash recovery replays. Its next op, whenever it comes (a heartbeat
is not needed), first rebuilds it on the worker, just before the op runs, and training goes on
bit-exact. Checkpoints are files and never depended on residency.

A session that ends (`ServiceClient.close()` sends sessions/{id}/finish) has its runs released at
once, whatever the expiry (0 included): a run counts against its account's concurrent-run quota
exactly while the engine holds it (control/quotas.py), so a closed session's place is freed now,
and a run used again later comes back like a new one.

Who does what:
- A reaper thread looks every `interval_s` for something to release. If there is, it queues one
  internal ReleaseAdaptersOp.
- The worker decides what that op releases when it runs it, because the queue may have changed in
  between. So a release never races an op of the same run.
- Released runs are recorded in the store (UnloadedRunRow), so that neither an engine crash nor a
  server restart rebuilds them before their next op.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from datetime import timedelta
from typing import Any, Callable

from tinkerd.control.engines import run_ops
from tinkerd.control.recovery import Recovery
from tinkerd.control.store.db import Store, utcnow
from tinkerd.control.store.runs import RunRepository
from tinkerd.control.store.sampling import SamplingSessionRepository
from tinkerd.control.store.sessions import SessionRepository
from tinkerd.errors import TinkerdError
from tinkerd.types import ReleaseAdaptersOp, Resident

log = logging.getLogger(__name__)

# The internal release op's queue target: no run or sampling session has an id like it.
RELEASE_TARGET = "tinkerd:release"


class Residency:
    def __init__(self, store: Store, recovery: Recovery, expiry_s: float):
        self.store = store
        self.runs = RunRepository(store)
        self.recovery = recovery
        self.expiry_s = expiry_s
        # A quarter of the expiry, within [0.5 s, 30 s]: a run is released at most ~25% late, and the
        # reaper's two small queries every 30 s cost nothing against the default 300 s expiry. A
        # session's end wakes it at once (poke).
        self.interval_s = min(30.0, max(0.5, expiry_s / 4)) if expiry_s > 0 else 30.0
        # Released runs; read and changed on the worker thread only (and at start, before it runs).
        self.unloaded: set[str] = set(self.runs.unloaded())
        # What the engine reported holding after its last step; None before the first.
        self.resident: Resident | None = None
        self._release_queued = False
        # Runs a client asked to unload (request_release), released like idle ones when not busy.
        self.requested: set[str] = set()
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None

    # -- the reaper --------------------------------------------------------------------------------

    def start(self, enqueue: Callable[[str, str, Any, Callable], None], busy: Callable[[str], bool]) -> None:
        """Look for idle sessions every interval_s; `enqueue(request_id, target, op, finalize)` queues
        an internal op, `busy(target)` says whether a target has ops queued or running."""

        def loop() -> None:
            while True:
                self._wake.wait(self.interval_s)
                self._wake.clear()
                if self._stop.is_set():
                    return
                try:
                    self._tick(enqueue, busy)
                except Exception:  # a failed look must not end the thread; the next one retries
                    log.exception("looking for idle sessions failed")

        self._thread = threading.Thread(target=loop, name="tinkerd-residency", daemon=True)
        self._thread.start()

    def poke(self) -> None:
        """Look now (a session ended), not at the next interval."""
        self._wake.set()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=10)

    def _tick(self, enqueue, busy) -> None:
        if self._release_queued or not (self.idle_runs(busy) or self.idle_sampler_paths()):
            return
        self._release_queued = True
        enqueue(f"internal-{uuid.uuid4().hex}", RELEASE_TARGET, ReleaseAdaptersOp(), self._released)

    # -- what is idle --------------------------------------------------------------------------------

    def request_release(self, model_id: str) -> None:
        """Release `model_id` at the next look once nothing of it is queued or running (an explicit
        unload). An op that comes later finds it released and rebuilds it, as after any release."""
        self.requested.add(model_id)
        self.poke()

    def idle_runs(self, busy: Callable[[str], bool]) -> list[str]:
        """Loaded runs of ended sessions, runs asked to be released, and (expiry on) runs of gone
        sessions that are themselves idle for expiry_s; with nothing queued or running."""
        cutoff = utcnow() - timedelta(seconds=self.expiry_s) if self.expiry_s > 0 else None
        return [m for m in self.runs.idle(self.requested, cutoff) if not busy(m)]

    def idle_sampler_paths(self) -> list[str]:
        """Sampler adapters in the engine that sampling sessions of gone sessions use, and no live
        session does. Ones nobody's session names (sampled by model_path) are left to the sampler's
        own LRU bound."""
        paths = list(self.resident.sampler_paths) if self.resident is not None and self.expiry_s > 0 else []
        if not paths:
            return []
        rows = SamplingSessionRepository(self.store).with_adapter(paths)
        cutoff = utcnow() - timedelta(seconds=self.expiry_s)
        live = SessionRepository(self.store).heard_from_since({r.session_id for r in rows}, cutoff)
        used_by_live = {r.adapter_dir for r in rows if r.session_id in live}
        return sorted({r.adapter_dir for r in rows} - used_by_live)

    # -- on the worker -----------------------------------------------------------------------------

    def before_step(self, op: Any, engine, busy: Callable[[str], bool]) -> None:
        """Right before `op` runs: decide what a release op releases, or rebuild the released run the
        op needs. Raises EngineCrashed if the engine dies meanwhile (control recovers as for a step)."""
        if isinstance(op, ReleaseAdaptersOp):
            self._release_queued = False  # from here on the reaper may queue the next one
            op.models = [(m, self._snapshot_dir(m)) for m in self.idle_runs(busy)]
            op.sampler_paths = self.idle_sampler_paths()
            return
        model_id = getattr(op, "model_id", None)
        if model_id in self.unloaded:
            self._reload(model_id, engine)

    def _snapshot_dir(self, model_id: str) -> str | None:
        seq = self.recovery.last_snapshot_point(model_id)
        return self.recovery.snapshot_key(model_id, seq) if seq is not None else None

    def _reload(self, model_id: str, engine) -> None:
        t0 = time.perf_counter()
        plan = self.recovery.replay_plan([model_id])
        for op, result in zip(plan, run_ops(engine, plan)):
            if isinstance(result, TinkerdError):
                log.error("rebuilding released run %s: %s failed: %s", model_id, type(op).__name__, result.message)
        self.runs.mark_loaded(model_id)
        self.unloaded.discard(model_id)
        log.info("rebuilt released run %s from %d ops in %.2f s", model_id, len(plan), time.perf_counter() - t0)

    def _released(self, result: dict) -> tuple[bytes, str]:
        """Finalize of the release op (on the worker): record the runs no longer in the engine."""
        now = utcnow()
        for model_id in result["unloaded"]:
            self.requested.discard(model_id)
            self.runs.mark_unloaded(model_id, now)
            self.unloaded.add(model_id)
        if result["unloaded"] or result["sampler_paths"]:
            log.info("released %d training and %d sampler adapters of sessions ended or idle for %.0f s",
                     len(result["unloaded"]), len(result["sampler_paths"]), self.expiry_s)
        return b"", "application/json"

    def release_idle_at_start(self) -> set[str]:
        """At start-up, before the engine is rebuilt: runs of sessions already gone are not rebuilt
        now (their next op does it) and are recorded as released. Returns every released run."""
        now = utcnow()
        for model_id in self.idle_runs(lambda _: False):
            self.runs.mark_unloaded(model_id, now)
            self.unloaded.add(model_id)
        return set(self.unloaded)

    # -- reporting ---------------------------------------------------------------------------------

    def unloaded_runs_of(self, account_id: str | None) -> list[str]:
        """The account's released runs (all of them for None)."""
        return self.runs.unloaded(account_id)
