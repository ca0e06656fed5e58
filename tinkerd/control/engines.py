"""The engine seam's router: each base model to the EngineClient that serves it.

`EngineRouter` is itself an EngineClient, so control holds one whatever the placement: the embedded
process engine (one client serving every base model: each step passes straight through, as before
the router existed), or one Ray actor per base model (engine/ray_engine.py), whose sub-batches run at
the same time on their own threads.

A step is split by the base model each op carries (docs/op-contract.md). Ops recorded before ops
carried it (`base_model == ""`) are routed by the run's create or load op, which the router saw: an
adapter only ever enters an engine through one (a replay starts with one too). `ReleaseAdaptersOp`
names runs of every base model: each engine gets it, releases what it holds, and a run counts as
released when every engine says so (an engine that lacks the run says so too).

A crash is the dead engine's alone (`EnginesCrashed`): the router knows which engine died, so the
step's other sub-batches finish and their results come back with the crash (`output`), together
with the tickets the dead engine held (`lost`: its ops of that step and its sampling rows) and the
base models it served. Control re-queues only the lost tickets and rebuilds only the runs of those
base models (control/recovery.py); `restart` restarts only the engines that died, so a live engine's
adapters, rows in flight and finished ops are untouched (docs/architecture.md §9).
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Sequence

from tinkerd.errors import EngineCrashed, EnginesCrashed, NotFoundError, TinkerdError, UserError
from tinkerd.types import CreateModelOp, LoadWeightsOp, ReleaseAdaptersOp, Resident, ServedModel, StepBatch, \
    StepOutput, UnloadModelOp


def run_ops(engine, ops: Sequence[Any]) -> list[object]:
    """Run `ops` to completion in one StepBatch; one result (or TinkerdError) per op, in order.
    Recovery's replay and residency's rebuild go through the seam this way."""
    if not ops:
        return []
    tickets = [f"sync-{i}" for i in range(len(ops))]
    out = engine.step(StepBatch(run=list(zip(tickets, ops))))
    done = dict(out.done)
    return [done[t] for t in tickets]


class EngineRouter:
    def __init__(self, engines: Sequence[Any], on_close: Callable[[], None] | None = None):
        if not engines:
            raise ValueError("an EngineRouter needs at least one engine")
        self.engines = list(engines)
        self._on_close = on_close
        self._routes: dict[str, int] | None = None  # base model -> engine index, from models() on first use
        self._base_of: dict[str, str] = {}  # model_id -> base model, from the create/load ops routed
        self._admitted: dict[str, int] = {}  # sampling ticket in an engine -> that engine's index
        self._outputs: dict[int, StepOutput] = {}  # each engine's last step output (rows, residents)
        self._dead: set[int] = set()  # engines that died and were not restarted yet
        self._pool = ThreadPoolExecutor(len(self.engines), thread_name_prefix="tinkerd-router") \
            if len(self.engines) > 1 else None

    # -- the EngineClient protocol -----------------------------------------------------------------

    def step(self, batch: StepBatch) -> StepOutput:
        if len(self.engines) == 1:
            return self.engines[0].step(batch)
        subs: dict[int, StepBatch] = {}
        done: list[tuple[str, object]] = []
        broadcast: dict[str, list[object]] = {}  # release tickets -> each engine's result
        for ticket, op in batch.run:
            if isinstance(op, ReleaseAdaptersOp):
                broadcast[ticket] = []
                for i in range(len(self.engines)):
                    subs.setdefault(i, StepBatch()).run.append((ticket, op))
                continue
            try:
                i = self._engine_of(op)
            except TinkerdError as e:
                done.append((ticket, e))
                continue
            subs.setdefault(i, StepBatch()).run.append((ticket, op))
        for ticket, op in batch.admit:
            try:
                i = self._engine_of(op)
            except TinkerdError as e:
                done.append((ticket, e))
                continue
            subs.setdefault(i, StepBatch()).admit.append((ticket, op))
            self._admitted[ticket] = i
        for ticket in batch.cancel:
            if ticket in self._admitted:
                subs.setdefault(self._admitted[ticket], StepBatch()).cancel.append(ticket)
        if batch.decode:  # only engines with rows in flight: a step of an idle actor is a round trip for nothing
            for i in range(len(self.engines)):
                if i in subs and subs[i].admit or self._rows(i) > 0:
                    subs.setdefault(i, StepBatch()).decode = True
        outputs, crashes = self._step_all(subs)
        partial, shared, snapshot_s = [], [], 0.0
        for i, out in outputs.items():
            self._outputs[i] = out
            partial.extend(out.partial)
            shared.extend(out.shared_passes)
            snapshot_s = max(snapshot_s, out.snapshot_s)
            for ticket, result in out.done:
                self._admitted.pop(ticket, None)
                if ticket in broadcast:
                    broadcast[ticket].append(result)
                else:
                    done.append((ticket, result))
        lost = {t for i in crashes for t, _ in subs[i].run} | {t for t, i in self._admitted.items() if i in crashes}
        for ticket, results in broadcast.items():
            if ticket not in lost:
                done.append((ticket, _merge_release(results)))
        self._dead |= set(crashes)
        for i in crashes:
            self._forget(i)
        output = StepOutput(done, active_rows=sum(self._rows(i) for i in range(len(self.engines))),
                            resident=self._resident(), partial=partial, shared_passes=shared, snapshot_s=snapshot_s)
        if not crashes:
            return output
        first = next(iter(crashes.values()))
        raise EnginesCrashed(str(first), self._bases_of(crashes), frozenset(lost), output,
                             self_inflicted=any(e.self_inflicted for e in crashes.values())) from first

    def restart(self) -> float:
        """Restart the engines that died (every engine when none is known dead); the live ones keep
        their adapters and rows. A restart that fails raises EnginesCrashed naming what is still down."""
        t0 = time.perf_counter()
        if len(self.engines) == 1:
            return self.engines[0].restart()
        dead = sorted(self._dead) or list(range(len(self.engines)))
        for i in dead:
            self._forget(i)
        futures = {i: self._pool.submit(self.engines[i].restart) for i in dead}
        failed: dict[int, BaseException] = {}
        for i, f in futures.items():
            if f.exception() is None:
                self._dead.discard(i)
            else:
                failed[i] = f.exception()
                self._dead.add(i)
        for i, error in failed.items():
            if not isinstance(error, EngineCrashed):
                raise error
        if failed:
            first = next(iter(failed.values()))
            raise EnginesCrashed(str(first), self._bases_of(failed)) from first
        return time.perf_counter() - t0

    def models(self) -> list[ServedModel]:
        return [m for e in self.engines for m in e.models()]

    def close(self) -> None:
        try:
            for engine in self.engines:
                engine.close()
        finally:
            if self._pool is not None:
                self._pool.shutdown(wait=False)
            if self._on_close is not None:
                self._on_close()

    def kill(self) -> None:
        """Kill every engine that can be killed (a server stopped while its engines start)."""
        for engine in self.engines:
            getattr(engine, "kill", lambda: None)()

    # -- routing -----------------------------------------------------------------------------------

    def engine_key(self, op: Any) -> int | None:
        """The engine `op` will run on, None with one engine or where not known yet (the scheduler
        puts one training op per engine in a step: control/scheduler.py)."""
        if len(self.engines) == 1 or isinstance(op, ReleaseAdaptersOp):
            return None
        base = getattr(op, "base_model", "") or self._base_of.get(getattr(op, "model_id", None), "")
        return self._route_table().get(base)

    def _engine_of(self, op: Any) -> int:
        routes = self._route_table()
        base = getattr(op, "base_model", "") or self._base_of.get(getattr(op, "model_id", None), "")
        if not base:
            raise NotFoundError(f"unknown model_id {getattr(op, 'model_id', None)!r}")
        if base not in routes:
            raise UserError(f"base model {base!r} is not served here (served: {sorted(routes)})")
        if isinstance(op, (CreateModelOp, LoadWeightsOp)):
            self._base_of[op.model_id] = base
        elif isinstance(op, UnloadModelOp):
            self._base_of.pop(op.model_id, None)
        return routes[base]

    def _route_table(self) -> dict[str, int]:
        if self._routes is None:
            self._routes = {}
            for i, engine in enumerate(self.engines):
                for m in engine.models():
                    if not m.unavailable:
                        self._routes.setdefault(m.name, i)
        return self._routes

    def _step_all(self, subs: dict[int, StepBatch]) -> tuple[dict[int, StepOutput], dict[int, EngineCrashed]]:
        """Each engine's sub-batch on its own thread: the live engines' outputs and the dead ones' crashes."""
        futures = {i: self._pool.submit(self.engines[i].step, b) for i, b in subs.items()}
        outputs, crashes, errors = {}, {}, {}
        for i, f in futures.items():
            try:
                outputs[i] = f.result()
            except EngineCrashed as e:
                crashes[i] = e
            except Exception as e:  # noqa: BLE001  raised after the others finished
                errors[i] = e
        if errors and not crashes:
            raise next(iter(errors.values()))
        for i, e in errors.items():  # beside a crash: its state is unknown, so it is restarted and rebuilt too
            crashes[i] = EngineCrashed(f"engine client failed: {type(e).__name__}: {e}")
        return outputs, crashes

    def _forget(self, i: int) -> None:
        """Drop what the router knew of engine i's state (a fresh engine holds nothing; the replay's
        create and load ops route its runs again)."""
        self._outputs.pop(i, None)
        self._admitted = {t: j for t, j in self._admitted.items() if j != i}
        bases = self._bases_of({i: None})
        self._base_of = {m: b for m, b in self._base_of.items() if b not in bases}

    def _bases_of(self, engines) -> frozenset[str]:
        return frozenset(base for base, i in self._route_table().items() if i in engines)

    def _rows(self, i: int) -> int:
        out = self._outputs.get(i)
        return out.active_rows if out is not None else 0

    def _resident(self) -> Resident | None:
        parts = [o.resident for o in self._outputs.values() if o.resident is not None]
        if not parts:
            return None
        return Resident(training=sum(p.training for p in parts),
                        sampler_paths=tuple(path for p in parts for path in p.sampler_paths),
                        kv_cache_bytes=sum(p.kv_cache_bytes for p in parts),
                        kv_cache_budget_bytes=sum(p.kv_cache_budget_bytes for p in parts),
                        recomputed_layers=sum(p.recomputed_layers for p in parts))


def _merge_release(results: list[object]) -> object:
    """One ReleaseAdaptersOp's result from every engine's: a run is released when every engine
    released it or never held it; a sampler adapter when any engine dropped it."""
    for r in results:
        if isinstance(r, TinkerdError):
            return r
    unloaded = set(results[0]["unloaded"])
    for r in results[1:]:
        unloaded &= set(r["unloaded"])
    samplers = sorted({p for r in results for p in r["sampler_paths"]})
    return {"unloaded": [m for m in results[0]["unloaded"] if m in unloaded], "sampler_paths": samplers}
