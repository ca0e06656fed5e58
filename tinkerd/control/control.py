"""The control plane facade: accept ops durably, queue them, run them through the engine, store results.

Flow of one op: `submit` stores the op's record (write-ahead, control/oplog.py) and returns a
request_id; the op waits in the in-memory OpQueue; the worker thread loops over engine steps, each
picked by the Scheduler (one training op, or sampling admissions plus one decode step) and handed to
the EngineClient; a step returns the ops that finished in it, which may have been admitted steps
earlier (sampling). For each, control does the op's bookkeeping from its record (bookkeeping.py)
and stores its domain result (the API encodes it for the wire when it is retrieved); long-polling
`retrieve_future` callers wake up. The worker blocks only while the engine has no rows in flight and nothing waits.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any, Protocol

from anyio import to_thread

from tinkerd.control import oplog, retention
from tinkerd.control.bookkeeping import Bookkeeper
from tinkerd.control.backpressure import QueueBudget
from tinkerd.control.claims import Claimer
from tinkerd.control.crashes import EngineCrashes
from tinkerd.control.diskspace import DiskReserve
from tinkerd.control.futures import FutureHub
from tinkerd.control.metering import Meter
from tinkerd.control.metrics import Metrics
from tinkerd.control.notify import LocalNotifier, Notifier
from tinkerd.control.pauses import PauseBoard
from tinkerd.control.queue import Finalize, OpQueue, QueuedOp, Work
from tinkerd.control.quotas import Quotas
from tinkerd.control.recovery import Recovery
from tinkerd.control.residency import Residency
from tinkerd.control.results import ResultStore
from tinkerd.control.retention import FutureRetention, forgotten
from tinkerd.control.scheduler import Picked, Scheduler
from tinkerd.control.store.db import Store, utcnow
from tinkerd.control.store.futures import FutureRepository
from tinkerd.control.store.tables import FutureRow
from tinkerd.errors import EngineCrashed, ServerError, TinkerdError, UnrecoverableRun, UserError
from tinkerd.types import ServedModel, StepBatch, StepOutput

log = logging.getLogger(__name__)

class EngineClient(Protocol):
    """The seam between control and compute.

    `step` runs one scheduler-picked StepBatch and returns (ticket, result or TinkerdError) for
    every op that finished in it, plus the sampling rows still in flight (step again while > 0).
    """

    def step(self, batch: StepBatch) -> StepOutput: ...

    def restart(self) -> float:
        """A fresh engine after a crash (EngineCrashed); returns the seconds it took. Control then
        rebuilds its adapters through `step` (docs/op-contract.md). A router restarts only the
        engines that died (control/engines.py)."""
        ...

    def models(self) -> list[ServedModel]: ...

    def close(self) -> None: ...


@dataclass
class Accepted:
    request_id: str
    # False when (target, seq_id) was seen before: the original future is returned, nothing re-runs.
    new: bool


class Control:
    def __init__(self, store: Store, engine: EngineClient, recovery: Recovery | None = None,
                 quotas: Quotas | None = None, residency: Residency | None = None,
                 retention: FutureRetention | None = None, reserve: DiskReserve | None = None,
                 runs=None, ephemeral_samplers_kept: int = 2, worker_id: str | None = None):
        self.store = store
        # Replicas on one PostgreSQL (docs/deployment.md): `engine` None is an api replica, which
        # stores ops for the driver and runs none; `worker_id` names the driver, which claims what
        # api replicas stored (claims.py). Both None: the embedded server, one process.
        self.worker_id = worker_id
        # What an accepted op's success does (registers checkpoints, creates samplers) in the runs
        # (control/runs.py); without runs (unit tests) only ops without such effects can run.
        self.bookkeeper = Bookkeeper(runs, ephemeral_samplers_kept, self.busy)
        self.engine = engine
        # Snapshots and replay; None runs without (unit tests of the queue, say).
        self.recovery = recovery
        # Releases adapters of sessions that stopped heart-beating and rebuilds them on their next
        # op; None keeps every adapter loaded.
        self.residency = residency
        # Expires and deletes finished futures in the background; None keeps them all.
        self.retention = retention
        # The data directory's free-space reserve: new work is refused under it (diskspace.py); None
        # never refuses.
        self.reserve = reserve
        # Bounds on ops waiting (backpressure.py): new work beyond them is answered 429; None never refuses.
        self.budget: QueueBudget | None = None
        self.queue = OpQueue(lane_of=lambda work: Scheduler.lane_of(work.op))
        # Ops suspected of killing the engine: request_id -> such deaths (crashes.py, scheduler.py).
        self._suspects: dict[str, int] = {}
        # Per-account quotas: the scheduler passes over paused accounts; metered usage fills their windows.
        self.scheduler = Scheduler(self.queue, quotas=quotas, suspects=self._suspects,
                                   engine_of=getattr(engine, "engine_key", None))
        self.hub = FutureHub()
        # Wakes this process's waiters, or every replica's (use_notifier; control/notify.py).
        self.notifier: Notifier = LocalNotifier(self.hub)
        # The op log's reads and writes for the api layer (retrieve_future's owner check, the legacy conversion).
        self.futures = FutureRepository(store)
        self.claimer = Claimer(self.futures, worker_id, self._take) if worker_id else None
        # The driver posts its quota pauses for api replicas' retrieve_future (pauses.py).
        self.pauses = PauseBoard(self.futures, self.queue, self.scheduler) if worker_id else None
        self.meter = Meter(store)
        if quotas is not None:
            self.meter.listeners.append(quotas.on_usage)
        self._worker: threading.Thread | None = None
        # Ops handed to the engine and not finished yet: request_id -> (op, monotonic admit time).
        self._inflight: dict[str, tuple[QueuedOp, float]] = {}
        self._stopping = threading.Event()
        # Stores finished ops' outcomes, retrying storage faults until they land (results.py).
        self.results = ResultStore(store, self.meter, self.hub, self._stopping.is_set, finalize=self._finalize)
        # GET /metrics (control/metrics.py): events counted at the calls below, state read when scraped.
        self.metrics = Metrics()
        self.meter.listeners.append(self.metrics.on_usage)
        self.metrics.bind(self)
        self.results.on_stored = self.metrics.completed
        # Restarts a crashed engine and re-queues or fails what it held (crashes.py).
        self.crashes = EngineCrashes(engine, recovery, residency, self.metrics, self.queue, self._inflight,
                                     self._suspects, self._complete)
        # Sampling tickets to stop, handed to the engine with the next step (cancel_future).
        self._cancels: set[str] = set()
        self._cancels_lock = threading.Lock()

    @property
    def engine_state(self) -> str:
        """The engine's state: "running", "restarting" (rebuilding after a crash), or "down" (the last restart gave up)."""
        return self.crashes.state

    # -- lifecycle -------------------------------------------------------------------------------

    def use_notifier(self, notifier: Notifier) -> None:
        """Before start: wake-ups, work and cancels go through `notifier` (store/listen.py on PostgreSQL)."""
        self.notifier = notifier
        self.results.hub = notifier  # ResultStore calls its notify() once an outcome is stored

    def start(self) -> None:
        """Recover what a previous server process left (adapters, pending ops), then serve."""
        self.notifier.start()
        if self.engine is None:
            return  # an api replica: the driver recovers and runs the ops
        if self.worker_id is not None:
            # Every pending op is this driver's now, a previous driver's claims included; ops api
            # replicas store from here on are left unclaimed for the claimer, which starts after recovery.
            self.futures.claim_all_pending(self.worker_id)
        if self.recovery is not None:
            self._recover_from_store()
        self._worker = threading.Thread(target=self._run, name="tinkerd-engine", daemon=True)
        self._worker.start()
        if self.claimer is not None:
            self.claimer.start()
            self.pauses.start()
        if self.residency is not None:
            self.residency.start(self._enqueue_internal, self.busy)
        if self.retention is not None:  # after recovery, which reads the rows it may delete
            self.retention.start()

    def _recover_from_store(self) -> None:
        # Runs of sessions that went away while the server was down are rebuilt on their next op.
        released = self.residency.release_idle_at_start() if self.residency is not None else set()
        report = self.recovery.rebuild_engine(self.engine, skip=released)
        requeued = 0
        for row in self.recovery.pending():
            if self.worker_id is not None and row.claimed_by != self.worker_id:
                continue  # stored by an api replica after this driver's claim above: the claimer takes it
            requeued += self._take(row)
        if report.replayed_ops or requeued:
            log.warning("server recovered: rebuilt %d adapters from %d ops in %.2f s, re-queued %d pending ops",
                        report.models, report.replayed_ops, report.seconds, requeued)

    def _take(self, row: FutureRow) -> bool:
        """Queue a stored pending op (recovery, or a claim of an api replica's op); False: failed instead."""
        reason = self.recovery.failure(row.target) if self.recovery is not None else None
        try:
            if reason is not None:
                raise UnrecoverableRun(reason)
            work = self.recovery.rebuild(row)
        except TinkerdError as e:  # unreadable record, or its run could not be rebuilt: say why
            self.store.update(FutureRow, row.request_id, status="failed", error=e.message,
                              error_category=e.category, completed_at=utcnow())
            self.notifier.notify(row.request_id, row.target)
            return False
        self.queue.put(row.request_id, row.target, row.seq_id, row.request_type, work)
        return True

    def stop(self) -> None:
        self._stopping.set()  # a result stuck on storage is abandoned: it stays pending in the log
        if self.claimer is not None:
            self.claimer.stop()
            self.pauses.stop()
        self.notifier.close()
        if self.engine is None:
            self.metrics.close()
            return
        if self.retention is not None:
            self.retention.stop()
        if self.residency is not None:
            self.residency.stop()
        self.queue.close()
        if self._worker is not None:
            self._worker.join(timeout=30)
        self.engine.close()
        self.metrics.close()

    # -- accepting work --------------------------------------------------------------------------

    def submit(
        self,
        request_type: str,
        target: str,
        seq_id: int | None,
        body: bytes,
        work: Work,
        account_id: str | None = None,
        idempotency_key: str | None = None,
    ) -> Accepted:
        """Store the op, then queue it. Idempotent on (target, seq_id) when seq_id is given, else on
        (target, idempotency_key) when the client sent one (hpcai's X-Idempotency-Key).

        The log stores `work.record` (its domain form). `body` is stored only for work without a
        record, in the pre-v1 form a start converts through the API (api/legacy.py): the path of an
        op kind not yet given a record; every op of tinkerd's own carries one."""
        # The account is part of the key: an idempotent re-send is one client's, never another's.
        dedupe_key = retention.dedupe_key(request_type, account_id, target, seq_id, idempotency_key)
        if dedupe_key is not None:
            existing = self.store.future_by_dedupe_key(dedupe_key)
            if existing is not None:
                return Accepted(existing.request_id, new=False)
            if forgotten(self.store, request_type, account_id, target, seq_id):
                # Its future was deleted by retention (control/retention.py): the op ran once already.
                raise UserError(f"{request_type} seq_id {seq_id} of {target} was accepted before and its record has "
                                f"since expired; it is not run again. New work needs a new seq_id")
        if self.reserve is not None:  # after the re-send check: a re-sent op is not new work
            self.reserve.check()
        if self.budget is not None:  # after the re-send check too: what was accepted is never refused
            self.budget.check(self.queue, target, self.metrics.refused)
        if self.recovery is not None and seq_id is not None:
            reason = self.recovery.failure(target)
            if reason is not None:
                raise UnrecoverableRun(reason)
        if work.record is not None:
            body, op_version = oplog.dumps(work.record), oplog.SCHEMA_VERSION
        else:
            op_version = None
        request_id = f"req-{uuid.uuid4().hex}"
        row = FutureRow(
            request_id=request_id,
            request_type=request_type,
            target=target,
            seq_id=seq_id,
            dedupe_key=dedupe_key,
            account_id=account_id,
            body=body,
            op_version=op_version,
            status="pending",
            created_at=utcnow(),
            claimed_by=self.worker_id,
        )
        if not self.store.add(row):
            # Lost a race with an identical concurrent submission: return the winner's future.
            existing = self.store.future_by_dedupe_key(dedupe_key) if dedupe_key else None
            if existing is None:
                raise ServerError("could not store the request")
            return Accepted(existing.request_id, new=False)
        if self.engine is None:
            self.notifier.work()  # an api replica: the driver claims it (claims.py)
        else:
            self.queue.put(request_id, target, seq_id, request_type, work)
        self.metrics.accepted(request_type, Scheduler.lane_of(work.op), request_id)
        return Accepted(request_id, new=True)

    def accepted_before(self, request_type: str, target: str, seq_id: int | None, account_id: str | None) -> bool:
        """Whether this (target, seq_id) was accepted already: a preparer skips checks against what
        the op itself may since have done (an export's name now taken by its own files)."""
        key = retention.dedupe_key(request_type, account_id, target, seq_id)
        return key is not None and self.store.future_by_dedupe_key(key) is not None

    def release_run(self, model_id: str | None = None) -> None:
        """Release a run's adapter as soon as it is idle (hpcai's unload_model), or with None look for
        runs to release now (a session ended); an api replica asks the driver. No-op without residency."""
        if self.engine is None:
            self.notifier.release(model_id)
        elif self.residency is not None:
            self.residency.request_release(model_id) if model_id is not None else self.residency.poke()

    def complete_now(self, request_type: str, target: str, payload: bytes, media_type: str,
                     account_id: str | None = None) -> str:
        """A future that is already done (ops with no engine work), so the SDK can poll it as usual."""
        request_id = f"req-{uuid.uuid4().hex}"
        now = utcnow()
        self.store.add(
            FutureRow(
                request_id=request_id, request_type=request_type, target=target, account_id=account_id,
                body=b"", status="complete",
                result=payload, result_media_type=media_type, created_at=now, completed_at=now,
            )
        )
        return request_id

    def _enqueue_internal(self, request_id: str, target: str, op: Any, finalize: Finalize) -> None:
        """Queue an op of the server's own (no stored future, nobody billed); it runs in turn."""
        self.queue.put(request_id, target, None, type(op).__name__, Work(op, finalize))

    def busy(self, target: str) -> bool:
        """Whether `target` has ops queued or in the engine (exact on the worker thread)."""
        return self.queue.depth(target) > 0 or any(q.target == target for q, _ in list(self._inflight.values()))

    def running(self) -> list[QueuedOp]:
        """The ops in the engine now (a snapshot, for the console's queue page)."""
        return [q for q, _ in list(self._inflight.values())]

    # -- results ---------------------------------------------------------------------------------

    def _finalize(self, work: Work, result: Any) -> tuple[bytes, str]:
        """On the worker, after the engine succeeded: the op's bookkeeping, then its stored result."""
        if work.record is None:
            return work.finalize(result)
        return oplog.dumps(self.bookkeeper.outcome(work.record, result)), oplog.DOMAIN_RESULT

    async def retrieve(self, request_id: str, timeout_s: float, row: FutureRow | None = None) -> FutureRow | None:
        """The future's row once it is done, or still pending after `timeout_s`; None if unknown.
        `row`: the future as the caller has just read it (its owner check), so it is not read twice.
        A coroutine on the server's loop; every store call goes to the thread pool (api/routes/futures.py)."""
        if row is None:
            row = await to_thread.run_sync(self.store.get, FutureRow, request_id)
        if row is None or row.status != "pending":
            return await to_thread.run_sync(self._retrieved, row)

        def is_done() -> bool:
            return self.futures.status(request_id) not in (None, "pending")

        if await self.hub.wait(request_id, timeout_s, lambda: to_thread.run_sync(is_done)):
            # Read again: the wake-up means the result is stored now, whatever an earlier check read
            # (returning that stale pending row cost every op a second round trip and a warning).
            return await to_thread.run_sync(lambda: self._retrieved(self.store.get(FutureRow, request_id)))
        return row

    def pause_reason(self, request_id: str) -> str | None:
        """Why a pending op waits on its account's quota (retrieve_future's queue_state), or None: the
        scheduler's answer, or on an api replica (no queue) what the driver last posted (pauses.py)."""
        if self.engine is None:
            return self.futures.paused_reason(request_id)
        return self.scheduler.pause_reason(request_id)

    def cancel(self, row: FutureRow) -> None:
        """Stop a pending sampling request whose client gave up on it (cancel_future). Still queued:
        taken out, and the worker stores it failed at its next turn (_run), through the same
        ResultStore retries as every outcome; this thread stores nothing. Otherwise (in the engine, or
        about to be) its ticket goes to the engine with the next step, which drops its rows and
        returns it failed. Nothing is billed: only completed ops record usage. A finished request is
        left as it is."""
        if row.status != "pending":
            return
        if row.request_type != "Sample":
            raise UserError(f"only sampling requests can be cancelled; {row.request_id} is a {row.request_type}")
        if self.engine is None:
            self.notifier.cancel(row.request_id)  # the driver holds it (cancel_id there)
            return
        if self.queue.withdraw(row.request_id):
            return
        with self._cancels_lock:
            self._cancels.add(row.request_id)

    def cancel_id(self, request_id: str) -> None:
        """On the driver, from the notifier: an api replica's cancel_future (checked there)."""
        row = self.futures.get(request_id)
        if row is not None and row.request_type == "Sample":
            self.cancel(row)

    def expired_message(self, request_id: str) -> str:
        if self.retention is not None:
            return self.retention.expired_message(request_id)
        return f"request_id {request_id!r} has expired"

    def _retrieved(self, row: FutureRow | None) -> FutureRow | None:
        """Note when a result or error is first handed out: its retention grace starts then."""
        if row is not None and row.status != "pending" and row.retrieved_at is None and row.expired_at is None:
            row.retrieved_at = utcnow()
            self.futures.mark_retrieved(row.request_id, row.retrieved_at)
        return row

    # -- the worker ------------------------------------------------------------------------------

    def _run(self) -> None:
        active_rows = 0
        while (picked := self.scheduler.next(active_rows)) is not None:
            try:
                self._store_withdrawn()
                active_rows = self._execute(picked)
            except Exception:  # the worker must outlive any bug: log it, keep serving
                log.exception("engine worker step failed")
                active_rows = 0
        self._store_withdrawn()  # stopping: cancels that came in last are still stored, not re-run after a restart

    def _store_withdrawn(self) -> None:
        """Fail the queued samples their clients cancelled (Control.cancel), on this thread like every
        other outcome, so a storage fault is retried (results.py) instead of failing the API call."""
        for q in self.queue.take_withdrawn():
            self._complete(q, UserError("cancelled by the client (cancel_future) before it started"), 0.0)

    def _execute(self, picked: Picked) -> int:
        """One engine step; completes what finished in it. Returns the sampling rows still in flight."""
        t0 = time.perf_counter()
        for q in picked.ops:
            self._inflight[q.request_id] = (q, t0)
            if self.recovery is not None:
                self.recovery.maybe_snapshot(q.op.op, q.seq_id)
        with self._cancels_lock:  # drained once this step's ops are in flight: a cancel meanwhile goes with them
            cancels, self._cancels = self._cancels, set()
        picked.batch.cancel = [rid for rid in cancels if rid in self._inflight]
        batch = picked.batch
        if not (batch.run or batch.admit or batch.decode or batch.cancel):
            return 0  # woken only to store withdrawn ops (cancel_future): nothing for the engine
        try:
            if self.residency is not None:
                for q in picked.ops:
                    self.residency.before_step(q.op.op, self.engine, self.busy)
        except EngineCrashed as e:  # died rebuilding a released run: this step's ops never reached it
            self.crashes.recover(e, unsent={q.request_id for q in picked.ops})
            return 0
        try:
            out = self.engine.step(picked.batch)
        except EngineCrashed as e:
            self.crashes.recover(e)
            # Behind a router, only the dead engine's work is lost: the live ones' results complete.
            out = getattr(e, "output", None)
            if out is None:
                return 0
        except Exception as e:  # the engine client itself broke: fail all it holds, keep serving
            log.exception("engine step failed")
            out = StepOutput([(rid, ServerError(f"engine failure: {e}")) for rid in self._inflight], active_rows=0)
        now = time.perf_counter()
        self.scheduler.charge(picked, now - t0)
        self.metrics.shared_passes(out.shared_passes)
        if self.recovery is not None:
            self.recovery.snapshot_spent(out.snapshot_s)
        if self.residency is not None and out.resident is not None:
            self.residency.resident = out.resident
        for request_id, deltas in out.partial:  # before `done`: a stream's last tokens precede its end
            self.notifier.publish(request_id, deltas)
        for request_id, result in out.done:
            entry = self._inflight.pop(request_id, None)
            if entry is None:  # failed above when the engine broke, finished by it later
                log.warning("engine returned a result for %s, which is not in flight", request_id)
                continue
            q, admitted_at = entry
            # Wall time in the engine: one step for a training op, admission to last token for a sample.
            self._complete(q, result, now - admitted_at, admitted_at - q.op.accepted_at)
        return out.active_rows

    def _complete(self, q: QueuedOp, result: Any, compute_s: float, queue_wait_s: float = 0.0) -> None:
        self._suspects.pop(q.request_id, None)
        self.results.complete(q, result, compute_s, queue_wait_s)

    # -- readiness -------------------------------------------------------------------------------

    def health(self) -> dict:
        """What a load balancer needs (GET /api/v1/readyz): whether this server should get new work,
        and why not. Not ready while storage is under its reserve, a result waits on storage, the
        engine is restarting or down, or the worker thread is gone."""
        reasons = []
        storage = None
        if self.reserve is not None:
            disk = self.reserve.state()
            storage = disk.as_dict()
            if not disk.ok:
                reasons.append("storage under its free-space reserve")
        # Locked by another process or read-only: known before any write fails on it.
        write_error = self.store.write_probe()
        storage = {**(storage or {}), "writable": write_error is None, "write_error": write_error}
        if write_error is not None:
            reasons.append(f"storage not writable: {write_error}")
        stalled = self.results.stalled_since
        if stalled is not None:
            reasons.append("a finished op's result cannot be stored")
        if self.engine_state != "running":
            reasons.append(f"engine {self.engine_state}")
        # An api replica has no worker: the driver's state is its own readyz's.
        worker_alive = self.engine is None or (self._worker is not None and self._worker.is_alive())
        if not worker_alive:
            reasons.append("engine worker not running")
        return {
            "ready": not reasons,
            "reasons": reasons,
            "storage": storage,
            "engine": {"state": self.engine_state, "worker_alive": worker_alive, "queued_ops": self.queue.depth(),
                       "ops_in_flight": len(self._inflight),
                       "result_unstored_s": None if stalled is None else round(time.monotonic() - stalled, 1)},
        }
