"""Ray placement (`tinkerd serve --ray-address`): each base model's engine is a Ray actor.

One actor per base model, with the CPUs and GPUs the config asks for (`--ray-num-cpus`,
`--ray-num-gpus`), behind a `RayEngineClient` that is an EngineClient like the process engine's;
control reaches them through an EngineRouter (control/engines.py). Ray restarts an actor that dies
(max_restarts); the client turns the death into EngineCrashed, and control rebuilds that actor's
adapters by replay exactly as after a process engine's death; the other actors go on untouched
(control/engines.py).

An actor restarted by Ray between two steps would take the next step with none of its adapters.
So each incarnation draws an id when it starts, every step names the incarnation the client knows,
and an actor that is not it refuses the step untouched: the client then reports a crash, as if the
death had happened mid-step.

Batches and outputs cross as pickled bytes, as over the process engine's pipe: Ray's own numpy
serialization hands out read-only arrays, and the engine's results hold TinkerdErrors.
"""

from __future__ import annotations

import logging
import os
import pickle
import time
import uuid
from pathlib import Path

from tinkerd.artifacts import LocalArtifactStore
from tinkerd.errors import EngineCrashed, EngineStartFailed, TinkerdError, UserError
from tinkerd.engine.precision import Precision
from tinkerd.engine.process import EngineSpec
from tinkerd.types import ServedModel, StepBatch, StepOutput

log = logging.getLogger(__name__)

NAMESPACE = "tinkerd"
# Actors are named `tinkerd-engine:<base model>:<server pid>`: found by the base model they serve
# (`ray list actors`, a test's ray.kill), and two servers on one cluster never share a name.
NAME_PREFIX = "tinkerd-engine:"
# Ray restarts a dead actor however often it dies (-1): every restart is one control asked for or
# recovers from, and control bounds them itself (its consecutive restart attempts, poison ops).
# A finite budget would be spent over a long-lived server's deaths.
MAX_RESTARTS = -1


class EngineActor:
    """Runs in the Ray worker: one Engine, reached through the in-process client."""

    def __init__(self, spec: EngineSpec):
        from tinkerd.engine.malloc import keep_freed_memory

        keep_freed_memory()  # as the engine process does (engine/malloc.py)
        logging.basicConfig(level=spec.log_level, **({"format": spec.log_format} if spec.log_format else {}))
        self.incarnation = uuid.uuid4().hex
        self.client, self.failed = None, None
        try:
            from tinkerd.engine.client import InProcessEngineClient

            self.client = InProcessEngineClient(spec.build())
        except Exception as e:  # reported by ready(), not raised: Ray would restart a failing start forever
            if not isinstance(e, TinkerdError):
                log.exception("engine actor: building the engine failed")
            self.failed = getattr(e, "message", None) or f"{type(e).__name__}: {e}"

    def ready(self) -> tuple[str, str | None, list[ServedModel], int]:
        """(incarnation, why the engine could not be built or None, what it serves, pid)."""
        return self.incarnation, self.failed, self.client.models() if self.client else [], os.getpid()

    def step(self, incarnation: str, batch: bytes) -> bytes | None:
        if incarnation != self.incarnation:  # restarted by Ray since the client last knew it: a fresh engine
            return None
        return pickle.dumps(self.client.step(pickle.loads(batch)), protocol=5)


class RayEngineClient:
    """The EngineClient of one base model's actor."""

    def __init__(self, spec: EngineSpec, num_cpus: float, num_gpus: float, start_timeout_s: float = 600.0):
        import ray

        self.spec = spec
        self.base_model = spec.base_models[0]
        self.name = f"{NAME_PREFIX}{self.base_model}:{os.getpid()}"
        self.start_timeout_s = start_timeout_s
        # The actor imports the tinkerd this server runs (a local cluster; a remote one needs the same
        # tinkerd on its workers' path).
        package_root = str(Path(__file__).resolve().parents[2])
        path = os.pathsep.join(p for p in (package_root, os.environ.get("PYTHONPATH")) if p)
        self._actor = ray.remote(EngineActor).options(
            name=self.name, namespace=NAMESPACE, num_cpus=num_cpus, num_gpus=num_gpus,
            max_restarts=MAX_RESTARTS, max_task_retries=0,  # control, not Ray, runs ops again (by replay)
            runtime_env={"env_vars": {"PYTHONPATH": path}},
        ).remote(spec)
        self._incarnation: str | None = None
        self._models: list[ServedModel] = []
        self._dead = False  # the actor died (Ray restarts it): restart() need not kill it
        self.pid: int | None = None
        self.restarts = 0

    def step(self, batch: StepBatch) -> StepOutput:
        self.models()  # the first step waits for the actor to be ready
        out = self._get(self._actor.step.remote(self._incarnation, pickle.dumps(batch, protocol=5)))
        if out is None:
            self._dead = True
            raise EngineCrashed(f"the engine actor of {self.base_model} was restarted by Ray since its last step")
        return pickle.loads(out)

    def models(self) -> list[ServedModel]:
        if self._incarnation is None:
            self._wait_ready()
        return list(self._models)

    def restart(self) -> float:
        """A fresh engine: Ray restarts a dead actor itself; a live one is killed for Ray to restart."""
        import ray

        t0 = time.perf_counter()
        if not self._dead and self._incarnation is not None:
            ray.kill(self._actor, no_restart=False)
        self._dead = False
        self._wait_ready()  # a new incarnation: the old one's id is what it must differ from
        self.restarts += 1
        return time.perf_counter() - t0

    def close(self) -> None:
        import ray

        try:
            ray.kill(self._actor, no_restart=True)
        except Exception:  # already gone, or Ray is: nothing to stop
            pass

    def kill(self) -> None:
        self.close()

    def _wait_ready(self) -> None:
        """Until the actor answers as a new incarnation (after a kill the old one may still answer
        for a moment); EngineStartFailed with the engine's reason if it could not build its engine."""
        import ray

        previous = self._incarnation
        deadline = time.monotonic() + self.start_timeout_s
        while True:
            try:
                incarnation, failed, models, pid = ray.get(self._actor.ready.remote(), timeout=self.start_timeout_s)
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError) as e:
                if time.monotonic() > deadline:
                    raise EngineCrashed(f"the engine actor of {self.base_model} did not start: {e}") from e
                time.sleep(0.2)
                continue
            if failed is not None:
                raise EngineStartFailed(failed)
            if incarnation != previous:
                self._incarnation, self._models, self.pid = incarnation, models, pid
                log.info("engine actor of %s is ready (pid %d)", self.base_model, pid)
                return

    def _get(self, ref):
        import ray

        try:
            return ray.get(ref)
        except ray.exceptions.RayActorError as e:
            self._dead = True
            raise EngineCrashed(f"the engine actor of {self.base_model} died: {type(e).__name__}") from e


def ray_engines(config, log_level: int = logging.WARNING, log_format: str | None = None) -> list[RayEngineClient]:
    """Connect to Ray (`--ray-address`; `local` starts a private one sized to the actors, stopped by
    `shutdown`) and start one engine actor per base model; they start loading at once, together."""
    try:
        import ray
    except ImportError as e:
        raise UserError("--ray-address needs Ray, which is not installed: pip install -r requirements/ray.txt") from e

    # ray.init on the main thread (`serve` calls this there) installs Ray's SIGTERM handler, which
    # exits through atexit and so ray.shutdown: kept, because a `local` Ray's dashboard and
    # runtime-env agents outlived a server that SIGTERM killed without it (seen: both still up 60 s on).
    if not ray.is_initialized():
        if config.ray_address == "local":
            n = len(config.base_models)
            ray.init(num_cpus=max(1, round(config.ray_num_cpus * n)), num_gpus=config.ray_num_gpus * n,
                     namespace=NAMESPACE, include_dashboard=False, log_to_driver=True)
        else:
            ray.init(address=config.ray_address, namespace=NAMESPACE, log_to_driver=True)
    threads = config.torch_threads or max(1, int(config.ray_num_cpus))
    clients = [RayEngineClient(EngineSpec(config.models_dir, (base,), config.max_lora_rank, threads,
                                          config.sample_kv_cache_bytes, precision=Precision(config.device, config.dtype),
                                          log_level=log_level, log_format=log_format,
                                          artifacts=LocalArtifactStore(config.data_dir),
                                          activation_memory_bytes=config.activation_memory_bytes),
                               config.ray_num_cpus, config.ray_num_gpus)
               for base in config.base_models]
    log.info("starting %d engine actors on Ray (%s)", len(clients), config.ray_address)
    return clients


def shutdown() -> None:
    """Disconnect from Ray (and stop the local one `--ray-address local` started)."""
    import ray

    ray.shutdown()
