"""The control plane facade: accept ops durably, queue them, run them through the engine, store results.

Flow of one op: `submit` stores the wire request (write-ahead) and returns a request_id; the op
waits in the in-memory OpQueue; the worker thread hands it to the EngineClient; `finalize` (supplied
by the caller with the op) does the op's bookkeeping and encodes the wire result; the result is
stored and long-polling `retrieve_future` callers wake up.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any, Callable, Protocol

from tinkerd.control.futures import FutureHub
from tinkerd.control.queue import OpQueue, QueuedOp
from tinkerd.control.store.db import Store, utcnow
from tinkerd.control.store.tables import FutureRow
from tinkerd.errors import ServerError, TinkerdError
from tinkerd.types import ServedModel

log = logging.getLogger(__name__)

# finalize(result) -> (payload bytes, media type); runs on the worker after the engine succeeded.
Finalize = Callable[[Any], tuple[bytes, str]]


class EngineClient(Protocol):
    """The seam between control and compute: run a batch, one result (or TinkerdError) per op."""

    def step(self, ops: list[Any]) -> list[Any]: ...

    def models(self) -> list[ServedModel]: ...

    def close(self) -> None: ...


@dataclass
class Work:
    op: Any
    finalize: Finalize


@dataclass
class Accepted:
    request_id: str
    # False when (target, seq_id) was seen before: the original future is returned, nothing re-runs.
    new: bool


class Control:
    def __init__(self, store: Store, engine: EngineClient):
        self.store = store
        self.engine = engine
        self.queue = OpQueue()
        self.hub = FutureHub()
        self._worker: threading.Thread | None = None

    # -- lifecycle -------------------------------------------------------------------------------

    def start(self) -> None:
        self._worker = threading.Thread(target=self._run, name="tinkerd-engine", daemon=True)
        self._worker.start()

    def stop(self) -> None:
        self.queue.close()
        if self._worker is not None:
            self._worker.join(timeout=30)
        self.engine.close()

    # -- accepting work --------------------------------------------------------------------------

    def submit(
        self,
        request_type: str,
        target: str,
        seq_id: int | None,
        body: bytes,
        work: Work,
    ) -> Accepted:
        """Store the op, then queue it. Idempotent on (target, seq_id) when seq_id is given."""
        dedupe_key = f"{request_type}|{target}|{seq_id}" if seq_id is not None else None
        if dedupe_key is not None:
            existing = self.store.future_by_dedupe_key(dedupe_key)
            if existing is not None:
                return Accepted(existing.request_id, new=False)
        request_id = f"req-{uuid.uuid4().hex}"
        row = FutureRow(
            request_id=request_id,
            request_type=request_type,
            target=target,
            seq_id=seq_id,
            dedupe_key=dedupe_key,
            body=body,
            status="pending",
            created_at=utcnow(),
        )
        if not self.store.add(row):
            # Lost a race with an identical concurrent submission: return the winner's future.
            existing = self.store.future_by_dedupe_key(dedupe_key) if dedupe_key else None
            if existing is None:
                raise ServerError("could not store the request")
            return Accepted(existing.request_id, new=False)
        self.queue.put(request_id, target, seq_id, request_type, work)
        return Accepted(request_id, new=True)

    def complete_now(self, request_type: str, target: str, payload: bytes, media_type: str) -> str:
        """A future that is already done (ops with no engine work), so the SDK can poll it as usual."""
        request_id = f"req-{uuid.uuid4().hex}"
        now = utcnow()
        self.store.add(
            FutureRow(
                request_id=request_id, request_type=request_type, target=target, body=b"", status="complete",
                result=payload, result_media_type=media_type, created_at=now, completed_at=now,
            )
        )
        return request_id

    # -- results ---------------------------------------------------------------------------------

    async def retrieve(self, request_id: str, timeout_s: float) -> FutureRow | None:
        """The future's row once it is done, or still pending after `timeout_s`; None if unknown."""
        row = self.store.get(FutureRow, request_id)
        if row is None or row.status != "pending":
            return row
        state: dict[str, FutureRow | None] = {"row": row}

        def is_done() -> bool:
            state["row"] = self.store.get(FutureRow, request_id)
            return state["row"] is not None and state["row"].status != "pending"

        await self.hub.wait(request_id, timeout_s, is_done)
        return state["row"]

    # -- the worker ------------------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            batch = self.queue.take()
            if batch is None:
                return
            self._execute(batch)

    def _execute(self, batch: list[QueuedOp]) -> None:
        t0 = time.perf_counter()
        try:
            results = self.engine.step([q.op.op for q in batch])
        except Exception as e:  # the engine client itself broke: fail this batch, keep serving
            log.exception("engine step failed")
            results = [ServerError(f"engine failure: {e}")] * len(batch)
        compute_s = (time.perf_counter() - t0) / max(len(batch), 1)
        for q, result in zip(batch, results):
            self._complete(q, result, compute_s)

    def _complete(self, q: QueuedOp, result: Any, compute_s: float) -> None:
        values: dict[str, Any] = {"completed_at": utcnow(), "compute_s": compute_s}
        if not isinstance(result, TinkerdError):
            try:
                payload, media_type = q.op.finalize(result)
                values.update(status="complete", result=payload, result_media_type=media_type)
            except TinkerdError as e:
                result = e
            except Exception as e:
                log.exception("finalizing %s failed", q.request_type)
                result = ServerError(f"{type(e).__name__}: {e}")
        if isinstance(result, TinkerdError):
            values.update(status="failed", error=result.message, error_category=result.category)
        self.store.update(FutureRow, q.request_id, **values)
        self.hub.notify(q.request_id)
