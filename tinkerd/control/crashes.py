"""Engine-crash handling: restart the engine, rebuild its adapters, re-queue or fail what it held.

The worker (control.py: Control._execute) calls `EngineCrashes.recover` when a step or a rebuild of
a released run raises EngineCrashed; everything here runs on that worker thread.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Collection

from tinkerd.control.queue import OpQueue, QueuedOp
from tinkerd.errors import EngineCrashed, ServerError, UserError

log = logging.getLogger(__name__)

# Consecutive failed engine starts after a crash before its in-flight ops are failed (~1 min of backoff).
_MAX_ENGINE_RESTARTS = 20
# Self-inflicted engine deaths (EngineCrashed.self_inflicted) an op may be in flight for, the last
# with nothing else in flight, before it is failed instead of run again. An op that kills the engine
# (one too big for memory, one that hits a native crash) would otherwise be re-queued after every
# restart and take everyone's in-flight work down with it, forever.
_POISON_CRASHES = 2


class EngineCrashes:
    """What the worker does when an engine dies: the engine's state, and the ops suspected of killing it."""

    def __init__(self, engine: Any, recovery: Any, residency: Any, metrics: Any, queue: OpQueue,
                 inflight: dict[str, tuple[QueuedOp, float]], suspects: dict[str, int],
                 complete: Callable[[QueuedOp, Any, float], None]):
        # The worker's parts (Control's): the engine client, snapshots and replay (None: none), the
        # released runs (None: every run stays loaded), the metrics, the queue ops go back into.
        self.engine, self.recovery, self.residency, self.metrics, self.queue = engine, recovery, residency, metrics, queue
        # Ops handed to the engine and not finished yet (Control._inflight): what a crash lost.
        self.inflight = inflight
        # Ops in flight when the engine died of what it was doing: request_id -> such deaths. The
        # scheduler runs them apart from other work (scheduler.py), so a death with one alone names it.
        self.suspects = suspects
        # complete(op, result or error, compute seconds): stores an outcome (Control._complete).
        self._complete = complete
        # "running", "restarting" (rebuilding after a crash), or "down" (the last restart gave up).
        self.state = "running"

    def recover(self, crash: Exception, unsent: Collection[str] = ()) -> None:
        """An engine died mid-step: start a new one, rebuild its adapters from snapshots and the log,
        and queue again everything it held (nothing of it was stored), except an op that has now
        killed it _POISON_CRASHES times, the last alone: that one is failed. Behind a router the
        crash names the dead engine's tickets and base models (control/engines.py: EnginesCrashed):
        only those are re-queued and rebuilt, and the live engines' work goes on untouched.
        `unsent`: this step's ops, which never reached an engine (re-queued, suspected of nothing)."""
        t0 = time.perf_counter()
        self.state = "restarting"
        lost = getattr(crash, "lost", None)
        if lost is None:  # one engine: everything in flight was in it
            inflight = [q for q, _ in self.inflight.values()]
            self.inflight.clear()
        else:
            gone = set(lost) | set(unsent)
            inflight = [self.inflight.pop(rid)[0] for rid in list(self.inflight) if rid in gone]
        bases = getattr(crash, "base_models", None)  # None: every run
        poison = self._suspect([q for q in inflight if q.request_id not in unsent], crash)
        for attempt in range(_MAX_ENGINE_RESTARTS):
            try:
                restart_s = self.engine.restart()
                released = self.residency.unloaded if self.residency is not None else ()
                report = self.recovery.rebuild_engine(self.engine, skip=released, base_models=bases) \
                    if self.recovery is not None else None
                self.metrics.engine_recovery("recovered", attempt + 1)
                break
            except EngineCrashed as e:  # died again while starting or rebuilding: start over
                log.warning("engine restart %d failed: %s", attempt + 1, e)
                more = getattr(e, "base_models", None)  # what is down now needs its rebuild too
                bases = None if bases is None or more is None else bases | more
                time.sleep(min(0.1 * 2**attempt, 5.0))
        else:
            # It cannot come back (a model that no longer loads, say): fail what it held, keep serving.
            self.state = "down"
            self.metrics.engine_recovery("down", _MAX_ENGINE_RESTARTS)
            for q in inflight:
                self._complete(q, ServerError(f"the engine crashed and could not restart: {crash}"), 0.0)
            return
        for q in inflight:
            if q is poison:
                self._complete(q, UserError(
                    f"this request was in flight each time the engine process died, {_POISON_CRASHES} times, the last "
                    f"time alone ({crash}); it is failed so that other work can go on. If it is large (samples x "
                    f"tokens, or a batch's tokens), send it smaller"), 0.0)
            else:
                self.queue.put(q.request_id, q.target, q.seq_id, q.request_type, q.op)
        self.state = "running"
        replayed = report.replayed_ops if report else 0
        log.warning("engine recovered in %.2f s (restart %.2f s) after %s; replayed %d ops, re-queued %d; "
                    "restarted the engine(s) of %s", time.perf_counter() - t0, restart_s, crash, replayed,
                    len(inflight), "every base model" if bases is None else ", ".join(sorted(bases)))

    def _suspect(self, inflight: list[QueuedOp], crash: Exception) -> QueuedOp | None:
        """Count a self-inflicted death against the ops in flight; returns the op to fail, if any: one
        in flight alone at its _POISON_CRASHES-th. A SIGKILL from outside counts against nobody."""
        if not getattr(crash, "self_inflicted", False):
            return None
        for q in inflight:
            self.suspects[q.request_id] = self.suspects.get(q.request_id, 0) + 1
        if len(inflight) == 1 and self.suspects[inflight[0].request_id] >= _POISON_CRASHES:
            log.error("failing %s %s: the engine died with it in flight %d times, the last alone",
                      inflight[0].request_type, inflight[0].request_id, _POISON_CRASHES)
            return inflight[0]
        return None
