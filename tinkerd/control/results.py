"""Storing what a finished op left: its bookkeeping (finalize), its usage and its FutureRow.

The engine has already applied the op when it gets here (an adapter's weights, grads or step
changed; a checkpoint's files are in place), so its outcome must land in the store exactly once,
whatever the store says now. A storage fault (errors.StorageUnavailable: disk full, I/O error,
database locked) is retried on the worker thread with back-off, 0.05 s doubling to 1 s, until the
write goes through: ops waiting behind it run within ~1 s of space coming back, no restart needed.

Why the worker blocks instead of parking the result and going on:
- ordering: no op of any run is handed to the engine while an earlier op's result is not stored.
  Recovery (recovery.py) rebuilds an adapter from its newest snapshot whose op is stored complete
  plus the stored complete ops after it, and re-runs pending ones. While a result is unstored, the
  log says "pending" for an op the engine has applied; a crash in that window re-runs it once on
  the rebuilt adapter (its own snapshot, if it took one, is skipped as not complete), which equals
  an uninterrupted run. Letting later ops of the run complete meanwhile would store results of ops
  whose predecessor the log cannot replay in order.
- the store is one SQLite file: when one result cannot be written, no other can either, so other
  runs' work would only pile up unstored results in memory.
Stopping the server during the window abandons the write: the op stays pending in the log and the
next start runs it again on the rebuilt adapter, as after a crash.

The steps are done in order, each once: finalize (it registers checkpoints and sampling sessions;
each is safe to redo after a failed write, which committed nothing), usage (keyed by request_id, a
redo keeps the first), then the FutureRow, then the long-polling callers are woken. Recorders
(ResultStore.recorders) run right after finalize.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, TypeVar

from tinkerd.control.futures import FutureHub
from tinkerd.control.metering import Meter
from tinkerd.control.queue import QueuedOp
from tinkerd.control.store.db import Store, utcnow
from tinkerd.control.store.tables import FutureRow
from tinkerd.errors import ServerError, StorageUnavailable, TinkerdError

log = logging.getLogger(__name__)

T = TypeVar("T")

# Back-off between attempts to store a result: 50 ms first (a "database is locked" from another
# process clears in ms), doubling to 1 s, so work resumes within ~1 s of space coming back while a
# stalled disk costs one failed UPDATE a second.
RETRY_FIRST_S = 0.05
RETRY_MAX_S = 1.0


class Abandoned(Exception):
    """The server is stopping while a result could not be stored; the op stays pending in the log."""


class ResultStore:
    def __init__(self, store: Store, meter: Meter, hub: FutureHub, stopping: Callable[[], bool],
                 first_s: float = RETRY_FIRST_S, max_s: float = RETRY_MAX_S,
                 finalize: Callable[[Any, Any], tuple[bytes, str]] | None = None):
        self.store = store
        # finalize(work, result) -> (stored result, media type): the op's bookkeeping (Control._finalize).
        self._finalize = finalize or (lambda work, result: work.finalize(result))
        self.meter = meter
        self.hub = hub
        self._stopping = stopping
        self._first_s = first_s
        self._max_s = max_s
        # monotonic time the result being stored now first failed; None while results land.
        self.stalled_since: float | None = None
        self.stalls = 0
        # recorder(request_id, op, result) for every op that finished well, after finalize and before
        # its future completes, so what a result refers to exists once the client can see it (the
        # recorded sequences of stable_reinforce: control/stability.py). Safe to redo, like finalize.
        self.recorders: list[Callable[[str, Any, Any], None]] = []
        # Called once the op's outcome is stored, before its callers wake: (q, result, compute_s,
        # queue_wait_s, engine_done perf_counter). Metrics (control/metrics.py) count the op here, so a
        # caller that has its result sees it counted.
        self.on_stored: Callable[[QueuedOp, Any, float, float, float], None] | None = None

    def complete(self, q: QueuedOp, result: Any, compute_s: float, queue_wait_s: float = 0.0) -> None:
        """Store the op's outcome, retrying storage faults until it lands (or the server stops)."""
        try:
            self._complete(q, result, compute_s, queue_wait_s, time.perf_counter())
        except Abandoned:
            log.error("server stopping with the result of %s %s unstored; it stays pending and runs again "
                      "after the restart", q.request_type, q.request_id)

    def _complete(self, q: QueuedOp, result: Any, compute_s: float, queue_wait_s: float, engine_done: float) -> None:
        values: dict[str, Any] = {"compute_s": compute_s}
        if not isinstance(result, TinkerdError):
            try:
                payload, media_type = self._until_stored(q, "finalize", lambda: self._finalize(q.op, result))
                for recorder in self.recorders:
                    self._until_stored(q, "record", lambda r=recorder: r(q.request_id, q.op.op, result))
                values.update(status="complete", result=payload, result_media_type=media_type)
            except Abandoned:
                raise
            except TinkerdError as e:
                result = e
            except Exception as e:
                log.exception("finalizing %s failed", q.request_type)
                result = ServerError(f"{type(e).__name__}: {e}")
        if isinstance(result, TinkerdError):
            values.update(status="failed", error=result.message, error_category=result.category)
        if values.get("status") == "complete" and q.op.billing is not None:
            # Recorded before the result is visible, so a caller that saw the result sees its usage.
            try:
                self._until_stored(q, "usage", lambda: self.meter.record(
                    q.request_id, q.request_type, q.target, q.op.billing, result, queue_wait_s, compute_s))
            except Abandoned:
                raise
            except Exception:  # a bug in metering must never fail or lose a finished op
                log.exception("recording usage of %s failed", q.request_id)

        def write() -> None:
            # completed_at is when the result landed: retention's clocks start when it can be fetched.
            self.store.update(FutureRow, q.request_id, completed_at=utcnow(), **values)

        self._until_stored(q, "result", write)
        if self.on_stored is not None:
            try:
                self.on_stored(q, result, compute_s, queue_wait_s, engine_done)
            except Exception:  # counting must never lose a finished op
                log.exception("on_stored of %s failed", q.request_id)
        self.hub.notify(q.request_id, q.target)

    def _until_stored(self, q: QueuedOp, what: str, fn: Callable[[], T]) -> T:
        delay, attempts, t0 = self._first_s, 0, None
        while True:
            try:
                out = fn()
            except StorageUnavailable as e:
                attempts += 1
                if t0 is None:
                    t0 = time.monotonic()
                    if self.stalled_since is None:
                        self.stalled_since = t0
                        self.stalls += 1
                    log.error("cannot store the %s of %s %s: %s; retrying until storage takes it (the engine has "
                              "applied the op; later ops wait behind it)", what, q.request_type, q.request_id,
                              e.message)
                if self._stopping():
                    raise Abandoned() from e
                time.sleep(delay)
                delay = min(delay * 2, self._max_s)
                continue
            if t0 is not None:
                log.warning("stored the %s of %s %s after %.1f s and %d failed attempts; work goes on", what,
                            q.request_type, q.request_id, time.monotonic() - t0, attempts)
                self.stalled_since = None
            return out
