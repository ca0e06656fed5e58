"""Recovery: rebuild training adapters after an engine crash (those of the engine that died) or a
server restart (every one).

An adapter's state is a pure function of its ops in seq_id order, so it is rebuilt from its last
snapshot plus the write-ahead log of the state-changing ops that completed after it. Failed ops
changed nothing (the engine validates before mutating), and forward-only ops, saves and samples
change no adapter, so none of those are replayed. Ops still pending are queued again and run as if
nothing happened; their clients were long-polling all along.

Snapshot policy: after an optim_step, when `snapshot_interval_s` has passed since the run's last
snapshot (default 10 s; the first step always snapshots), the engine writes the adapter and its
AdamW state as the artifact `snapshots/<model_id>/seq-<seq_id>` (tinkerd/artifacts.py) and drops the
older one. Replay is then at most the ops of one interval plus the forward_backward calls of the
step in flight, as long as the snapshots fit in `snapshot_budget`, the share of the engine's time
they may take (default 5%; the engine reports what they took: StepOutput.snapshot_s). Beyond it
every run's interval stretches alike, to (runs stepping) x (a snapshot's average cost) / budget,
instead of every tenant's steps slowing down: a rank-32 SmolLM2 snapshot costs the engine
~0.3 s of CPU (the copy in the step, then serialising and writing it), one run every 10 s spends
~3%, and four runs of 1 x 8 tokens each on 2 cores (2 threads, 24 steps per client, three
alternations) took 1120-1250 ms per round with a snapshot of each every 10 s, 1022-1190 within
the budget, 992-1206 with none (their optim_steps 77-86 ms against 48-57).
load_weights a snapshot is written too, whatever the interval: replay never reads a loaded
checkpoint again, so deleting it (or its TTL expiring) loses nothing. A run released from the
engine (control/residency.py) is snapshotted as of its last create, load or optim_step.

Ops are rebuilt from their stored records (control/oplog.py, docs/op-contract.md), as they were
accepted: never through the API, never checked against today's config. A run that cannot be rebuilt
(its base model is not served now, a stored op cannot be read, a logged op fails on replay) is
recorded with the reason (UnrecoverableRunRow): its pending and later ops fail with it, and a later
start that can rebuild it (the base model served again) clears the record.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Callable, Collection, Iterable

from tinkerd.artifacts import ArtifactStore, join
from tinkerd.control import oplog
from tinkerd.control.engines import run_ops
from tinkerd.control.queue import Work
from tinkerd.control.store.db import Store, utcnow
from tinkerd.control.store.futures import FutureRepository
from tinkerd.control.store.runs import RunRepository, TrainingRun
from tinkerd.control.store.tables import FutureRow, UnrecoverableRunRow
from tinkerd.errors import TinkerdError
from tinkerd.types import LoadWeightsOp, OptimStepOp, base_model_of

log = logging.getLogger(__name__)

# Request types whose completion changed an adapter's state.
STATE_CHANGING = ("CreateModel", "LoadWeights", "ForwardBackward", "OptimStep")
# The artifact key prefix of recovery snapshots: snapshots/<model_id>/seq-<seq_id, 12 digits>.
SNAPSHOTS = "snapshots"
# Ops after which an adapter has no pending grads, so weights + AdamW state + step are all of it:
# a snapshot is named after one of them (seq-<its seq_id>).
SNAPSHOT_POINTS = ("CreateModel", "LoadWeights", "OptimStep")


@dataclass
class RecoveryReport:
    models: int
    replayed_ops: int
    seconds: float


def rebuild_work(row: FutureRow) -> Work:
    """The accepted op of a stored future, as it was accepted; TinkerdError when it cannot be read."""
    return Work.of(oplog.load_record(row.body, row.op_version, row.request_id))


class Recovery:
    def __init__(self, store: Store, artifacts: ArtifactStore, rebuild: Callable[[FutureRow], Any] = rebuild_work,
                 snapshot_interval_s: float = 0.0, snapshot_budget: float = 1.0,
                 clock: Callable[[], float] = time.monotonic):
        self.store = store
        self.futures = FutureRepository(store)
        # Where the engine writes snapshots and this lists and reads them (tinkerd/artifacts.py).
        self.artifacts = artifacts
        # rebuild(row) -> Work: the op log's record decoded (a seam for unit tests of the plan).
        self.rebuild = rebuild
        self.snapshot_interval_s = snapshot_interval_s
        self._last_snapshot: dict[str, float] = {}
        # The budget (module docstring): what the engine reported spending on snapshots, how many
        # were asked of it, and when each run last asked (the runs sharing the budget).
        self.snapshot_budget = snapshot_budget
        self._clock = clock
        self._spent = 0.0
        self._taken = 0
        self._asked: dict[str, float] = {}
        # More debris sweeps to run before every rebuild, beside the snapshots' own: cli/serve.py
        # adds the checkpoints' (Checkpoints.sweep_stale_temp with older_than_s=0).
        self.sweeps: list[Callable[[], object]] = []

    # -- snapshots -------------------------------------------------------------------------------

    def maybe_snapshot(self, op: Any, seq_id: int | None) -> None:
        """Attach a snapshot key to an optim_step when the run's snapshot is due, and to every
        load_weights (replaying a load would need the checkpoint, which may be deleted by then)."""
        if seq_id is None:
            return
        if isinstance(op, LoadWeightsOp):
            op.snapshot_dir = self.snapshot_key(op.model_id, seq_id)
            self._taken += 1  # its cost is reported like any other's
            return
        if not isinstance(op, OptimStepOp):
            return
        now = self._clock()
        last = self._last_snapshot.get(op.model_id)
        if last is not None and now - last < self._spacing(op.model_id, now):
            return  # not due yet (a run's first step always snapshots)
        self._last_snapshot[op.model_id] = now
        self._taken += 1
        op.snapshot_dir = self.snapshot_key(op.model_id, seq_id)

    def snapshot_spent(self, seconds: float) -> None:
        """What the engine's snapshots took since its last step (StepOutput.snapshot_s)."""
        self._spent += seconds

    def _spacing(self, model_id: str, now: float) -> float:
        """Least seconds between this run's snapshots: the interval, or as long as the runs that
        take snapshots now need for their snapshots' average cost to stay within the budget. Every
        run gets the same spacing, so none waits on another's luck."""
        self._asked[model_id] = now
        if self.snapshot_budget >= 1.0 or not self._taken:
            return self.snapshot_interval_s
        cost = self._spent / self._taken
        spacing = self.snapshot_interval_s
        for _ in range(2):  # the runs asking within the spacing share it; a longer one counts more
            runs = sum(1 for t in self._asked.values() if now - t <= spacing)
            spacing = max(self.snapshot_interval_s, runs * cost / self.snapshot_budget)
        for stale in [m for m, t in self._asked.items() if now - t > 2 * spacing]:
            del self._asked[stale]  # a run that stopped stepping no longer shares the budget
        return spacing

    @staticmethod
    def snapshot_key(model_id: str, seq_id: int) -> str:
        return join(SNAPSHOTS, model_id, f"seq-{seq_id:012d}")

    def last_snapshot_point(self, model_id: str) -> int | None:
        """The seq_id of the run's last completed create, load or optim_step: the adapter's weights
        and AdamW state now are those it left (forward_backward calls since touch only grads)."""
        seqs = self.futures.completed_seqs(model_id, SNAPSHOT_POINTS)
        return max(seqs) if seqs else None

    def latest_snapshot(self, model_id: str) -> tuple[int, str] | None:
        """The newest snapshot whose op's result is stored, and its key. A snapshot written in the
        step the process died in belongs to an op that will run again, so it must not be used."""
        # The store lists only whole artifacts (tinkerd/artifacts.py).
        names = [k.rsplit("/", 1)[1] for k in self.artifacts.list(join(SNAPSHOTS, model_id))]
        seqs = sorted(int(n[4:]) for n in names if n.startswith("seq-") and n[4:].isdigit())
        for seq in reversed(seqs):
            if self.futures.completed_at(model_id, seq, SNAPSHOT_POINTS):
                return seq, self.snapshot_key(model_id, seq)
        return None

    # -- rebuilding ------------------------------------------------------------------------------

    def replay_plan(self, model_ids: Iterable[str] | None = None, skip: Collection[str] = (),
                    served: Collection[str] | None = None, base_models: Collection[str] | None = None) -> list[Any]:
        """Engine ops that rebuild adapters (every run's, or those of `model_ids`, or those trained on
        `base_models`; none of `skip`): per run, its snapshot then the logged ops after it. A run that
        cannot be rebuilt (its base model not in `served`, when given; a stored op that cannot be
        read) is recorded instead."""
        rows = self.futures.completed_of(STATE_CHANGING, model_ids)
        by_model: dict[str, list[FutureRow]] = {}
        for row in rows:
            if row.target not in skip:
                by_model.setdefault(row.target, []).append(row)
        plan: list[Any] = []
        for model_id, ops in by_model.items():
            run = RunRepository(self.store).get(model_id)
            if base_models is not None and not self._trained_on(run, ops, base_models):
                continue  # another engine's run: it is alive and holds it
            if served is not None and run is not None and base_model_of(run.base_model) not in served:
                self.record_failure(model_id, f"training run {model_id} was trained on {run.base_model}, which this "
                                    f"server does not serve now (tinkerd serve --base-model); its state is kept and "
                                    f"comes back when a restart serves {run.base_model} again")
                continue
            snap = self.latest_snapshot(model_id)
            steps: list[Any] = []
            if snap is not None:
                if run is None:
                    continue
                seq, path = snap
                steps.append(LoadWeightsOp(model_id, base_model_of(run.base_model), path, with_optimizer=True))
                ops = [r for r in ops if r.seq_id is not None and r.seq_id > seq]
            try:
                steps.extend(self.rebuild(row).op for row in ops)
            except TinkerdError as e:  # replaying around a hole would build a different adapter
                self.record_failure(model_id, f"training run {model_id} cannot be rebuilt: {e.message}")
                continue
            plan.extend(steps)
        return plan

    def _trained_on(self, run: TrainingRun | None, ops: list[FutureRow], base_models: Collection[str]) -> bool:
        if run is not None:
            return base_model_of(run.base_model) in base_models
        try:  # no run row (unit tests of the plan): the create or load op that made the adapter says
            return getattr(self.rebuild(ops[0]).op, "base_model", None) in base_models
        except TinkerdError:
            return True  # unreadable: the plan records why, whichever engine it was on

    def sweep_temp(self) -> int:
        """Remove what snapshot writes a dead engine left (ArtifactStore.sweep_incomplete), and run
        the other sweeps; returns how many snapshot temp dirs went. Only while no engine is in a
        step: at server start and after an engine restart, before the replay writes new snapshots."""
        swept = self.artifacts.sweep_incomplete(SNAPSHOTS)
        if swept:
            log.info("removed %d snapshot temp dir(s) of writes that never finished", len(swept))
        for sweep in self.sweeps:
            try:
                sweep()
            except Exception:  # disk space only: a failed sweep must not stop the recovery
                log.exception("sweeping temp dirs before the rebuild failed")
        return len(swept)

    def rebuild_engine(self, engine, skip: Collection[str] = (), base_models: Collection[str] | None = None
                       ) -> RecoveryReport:
        """Run the replay plan on a fresh engine (synchronously, before any new work); runs in
        `skip` (released ones) stay out until their next op. `base_models`: rebuild only the runs
        trained on them (the engines that died behind a router; None: every run). The dead engine's
        temp dirs go first: no engine is in a step meanwhile, so every temp dir is a dead write's."""
        self.sweep_temp()
        t0 = time.perf_counter()
        plan = self.replay_plan(skip=skip, served={m.name for m in engine.models()}, base_models=base_models)
        models = {op.model_id for op in plan}
        failed: set[str] = set()
        if plan:
            for op, result in zip(plan, run_ops(engine, plan)):
                if isinstance(result, TinkerdError) and op.model_id not in failed:
                    failed.add(op.model_id)
                    log.error("replay of %s for %s failed: %s", type(op).__name__, op.model_id, result.message)
                    self.record_failure(op.model_id, f"training run {op.model_id} could not be rebuilt after a "
                                        f"restart: replaying its {type(op).__name__} failed: {result.message}")
        for model_id in models - failed:
            self.store.delete(UnrecoverableRunRow, model_id)
        report = RecoveryReport(len(models - failed), len(plan), time.perf_counter() - t0)
        log.info("rebuilt %d adapters from %d ops in %.2f s: %s", report.models, report.replayed_ops, report.seconds,
                 ", ".join(sorted(models - failed)) or "none")
        return report

    def record_failure(self, model_id: str, reason: str) -> None:
        log.error("%s", reason)
        self.store.delete(UnrecoverableRunRow, model_id)
        self.store.add(UnrecoverableRunRow(model_id=model_id, reason=reason, at=utcnow()))

    def failure(self, target: str) -> str | None:
        """Why `target` (a training run) could not be rebuilt, if it could not."""
        row = self.store.get(UnrecoverableRunRow, target)
        return row.reason if row is not None else None

    def pending(self) -> list[FutureRow]:
        """Accepted ops that never finished, in the order they must run again."""
        return self.futures.pending()
