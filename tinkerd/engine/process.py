"""The engine in its own process: crash isolation behind the same EngineClient seam.

The API, the store and every acknowledged request live in the server process; the engine (models,
adapters, sampler) lives in a child process that talks over a pipe. If the child dies (OOM kill,
segfault, SIGKILL), `step` raises EngineCrashed, and control restarts it and rebuilds its adapters
from snapshots plus the write-ahead log (control/recovery.py). Ops and results cross the pipe
pickled; they are numpy arrays and small dataclasses, so a step's transfer costs about a
millisecond against the seconds of compute it carries.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from tinkerd.artifacts import ArtifactStore
from tinkerd.engine.malloc import children_use_huge_pages
from tinkerd.engine.precision import Precision
from tinkerd.errors import EngineCrashed, EngineFailure, EngineStartFailed, TinkerdError
from tinkerd.types import ServedModel

if TYPE_CHECKING:
    from tinkerd.engine.engine import Engine

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineSpec:
    """Everything a fresh engine process needs to build the same engine again."""

    models_dir: Path
    base_models: tuple[str, ...]
    max_lora_rank: int
    torch_threads: int | None
    sample_kv_cache_bytes: int | None = None
    # A spawned child starts with logging unconfigured, which would drop its INFO lines (the first
    # start's model conversion, load times) and print its warnings without the server's format.
    log_level: int = logging.WARNING
    log_format: str | None = None
    precision: Precision = Precision()  # device and compute dtype (engine/precision.py)
    # Rank processes of this one engine; above 1 the base model is FSDP2-sharded across them
    # (engine/sharding.py, --engine-ranks).
    ranks: int = 1
    # Where checkpoints, snapshots and exports go, by the keys ops carry (tinkerd/artifacts.py); the
    # engine reaches the data directory through it alone. None: keys are absolute paths (tests).
    artifacts: ArtifactStore | None = None
    # engine/recompute.py: bytes of activations a training pass may hold (None: by the free memory).
    activation_memory_bytes: int | None = None

    def build(self) -> Engine:
        """The Engine this spec describes, its base models loaded: what an engine process or a Ray
        actor runs (a rank of --engine-ranks builds its own, sharded: engine/sharding.py)."""
        import torch

        from tinkerd.engine.engine import Engine
        from tinkerd.engine.sampler.sample import SamplerConfig

        if self.torch_threads:
            torch.set_num_threads(self.torch_threads)
        engine = Engine(self.models_dir, self.max_lora_rank, SamplerConfig(kv_cache_bytes=self.sample_kv_cache_bytes),
                        self.precision, self.artifacts, self.activation_memory_bytes)
        engine.load_base_models(self.base_models)
        return engine


def _worker_main(conn, spec: EngineSpec) -> None:
    # Runs in the child: build the engine, report what it serves, then serve steps until EOF.
    from tinkerd.engine.malloc import keep_freed_memory

    keep_freed_memory()  # before anything is allocated: ~10% of a step went to page faults
    followers = None
    if spec.ranks > 1:  # this process is rank 0 of N; the others start now, their imports beside ours
        from tinkerd.engine.followers import Followers

        followers = Followers(spec)
    logging.basicConfig(level=spec.log_level, **({"format": spec.log_format} if spec.log_format else {}))
    # Ctrl-C reaches the whole process group: the server stops its engine itself (close, or a kill
    # when the engine is busy), so the child must not die of KeyboardInterrupt with a traceback of
    # wherever it happened to be.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})  # blocked by spawn(); now ignored
    try:  # out of memory, the kernel is to kill the engine (restarted, nothing lost), not the server
        with open("/proc/self/oom_score_adj", "w") as f:
            f.write("1000")
    except OSError:
        pass
    import torch

    from tinkerd.engine.client import InProcessEngineClient

    if spec.torch_threads:
        torch.set_num_threads(spec.torch_threads)
    try:
        if followers is not None:  # one engine over the ranks, the model FSDP2-sharded (engine/sharding.py)
            from tinkerd.engine.sharding import RankedEngineClient

            client = RankedEngineClient(spec, followers)
        else:
            client = InProcessEngineClient(spec.build())
    except Exception as e:
        reason = getattr(e, "message", None) or f"{type(e).__name__}: {e}"
        if not isinstance(e, TinkerdError):  # a user-facing reason needs no traceback; a bug does
            log.exception("engine process: building the engine failed")
        conn.send(("failed", reason))
        return
    conn.send(("ready", client.models()))
    while True:
        try:
            method, args = conn.recv()
        except EOFError:
            client.close()
            return
        if method == "close":
            client.close()
            return
        try:
            conn.send(("ok", getattr(client, method)(*args)))
        except Exception as e:  # the engine guards ops itself; this is a bug in the loop
            log.exception("engine process: %s failed", method)
            conn.send(("error", f"{type(e).__name__}: {e}"))


class ProcessEngineClient:
    def __init__(self, spec: EngineSpec, start_timeout_s: float = 600.0, wait: bool = True):
        """wait=False returns once the child is spawned; the first models() or step() waits for it
        to be ready. `tinkerd serve` uses that to import the API and open the store (~1.5 s) while
        the child imports torch and transformers and loads the model (~6 s on 2 shared cores)."""
        self.spec = spec
        self.start_timeout_s = start_timeout_s
        self._ctx = mp.get_context("spawn")  # a fork would copy the server's threads and locks
        self._proc = None
        self._conn = None
        self._starting = None  # (process, pipe end) spawned and not ready yet
        self._models: list[ServedModel] = []
        self.restarts = 0
        self.spawn()
        if wait:
            self.wait_ready()

    @property
    def pid(self) -> int | None:
        proc = self._starting[0] if self._starting is not None else self._proc
        return proc.pid if proc is not None else None

    def start(self) -> None:
        self.spawn()
        self.wait_ready()

    def spawn(self) -> None:
        parent, child = self._ctx.Pipe()
        proc = self._ctx.Process(target=_worker_main, args=(child, self.spec), name="tinkerd-engine", daemon=True)
        # While spawning, SIGINT is blocked in this thread, and the child inherits the block through
        # fork + exec: a Ctrl-C (sent to the whole process group) before _worker_main ignores SIGINT
        # stays pending there and is then discarded, instead of killing the child with a traceback
        # of its imports. Here, a Ctrl-C in that window (delivered to any thread) is only recorded,
        # and raised again once the child is recorded, so start-up stops and the child is found to
        # stop. Ignoring SIGINT around the start instead lost that Ctrl-C. Only the main thread may
        # set handlers; a restart (on the worker thread) keeps the narrow window it had.
        main = threading.current_thread() is threading.main_thread()
        interrupted: list[int] = []
        previous = signal.signal(signal.SIGINT, lambda signum, frame: interrupted.append(signum)) if main else None
        masked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        try:
            with children_use_huge_pages():  # the engine's weights on 2 MB pages (engine/malloc.py)
                proc.start()
            child.close()
            self._starting = (proc, parent)
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, masked)
            if main:
                signal.signal(signal.SIGINT, previous)
        if interrupted:
            signal.raise_signal(signal.SIGINT)  # to the handler in place: KeyboardInterrupt, or uvicorn's

    def wait_ready(self) -> None:
        """Wait for the spawned child's ready message (nothing to do once it came)."""
        if self._starting is None:
            return
        # Left in _starting while waiting, so that kill() from another thread finds the child.
        proc, parent = self._starting
        if not parent.poll(self.start_timeout_s):
            proc.kill()
            raise EngineCrashed("the engine process did not start in time")
        try:
            kind, models = parent.recv()
        except (EOFError, OSError) as e:
            proc.join(timeout=5)  # the exit code is known only once it is reaped
            raise EngineCrashed(f"the engine process died while starting (exit code {proc.exitcode})") from e
        finally:
            self._starting = None
        if kind == "failed":
            proc.join(timeout=10)
            raise EngineStartFailed(models)
        self._proc, self._conn, self._models = proc, parent, models

    def restart(self) -> float:
        """Replace a dead engine process with a fresh one; returns the seconds it took."""
        t0 = time.perf_counter()
        self._reap()
        self.start()
        self.restarts += 1
        return time.perf_counter() - t0

    def _reap(self) -> None:
        if self._starting is not None:  # closed before it was ready (Ctrl-C during start, say)
            self._proc, self._conn = self._starting
            self._starting = None
        if self._conn is not None:
            self._conn.close()
        if self._proc is not None:
            if self._proc.is_alive():
                self._proc.kill()
            self._proc.join(timeout=10)

    def _call(self, method: str, *args):
        self.wait_ready()
        oom_kills = _oom_kills()
        try:
            self._conn.send((method, args))
            kind, value = self._conn.recv()
        except (EOFError, BrokenPipeError, ConnectionResetError, OSError) as e:
            raise self._death(oom_kills) from e
        if kind == "error":
            raise EngineFailure(value)
        return value

    def _death(self, oom_kills_before: int | None) -> EngineCrashed:
        """What the engine process died of, once it is reaped (its exit code is known only then)."""
        self._proc.join(timeout=5)
        code = self._proc.exitcode
        after = _oom_kills()
        if code is not None and code < 0 and -code != signal.SIGKILL:
            name = signal.Signals(-code).name if -code in signal.valid_signals() else f"signal {-code}"
            return EngineCrashed(f"engine process {self.pid} died of {name}", self_inflicted=True)
        if code is not None and code > 0:
            return EngineCrashed(f"engine process {self.pid} exited with code {code}", self_inflicted=True)
        if code == -signal.SIGKILL and None not in (oom_kills_before, after) and after > oom_kills_before:
            return EngineCrashed(f"engine process {self.pid} was killed by the kernel's OOM killer "
                                 f"(the machine ran out of memory)", self_inflicted=True)
        return EngineCrashed(f"engine process {self.pid} died (exit code {code})")

    def step(self, batch):
        return self._call("step", batch)

    def models(self) -> list[ServedModel]:
        self.wait_ready()
        return list(self._models)

    def kill(self) -> None:
        """SIGKILL the child, starting or ready, from any thread: a wait for its ready message or a
        step in flight then raises EngineCrashed (a server stopped while it starts)."""
        proc = self._starting[0] if self._starting is not None else self._proc
        if proc is not None and proc.is_alive():
            proc.kill()

    def close(self) -> None:
        if self._starting is not None:  # not ready: nothing to say goodbye to
            self._reap()
            return
        if self._conn is not None and self._proc is not None and self._proc.is_alive():
            try:
                self._conn.send(("close", ()))
            except OSError:
                pass
            self._proc.join(timeout=10)
        self._reap()


def _oom_kills() -> int | None:
    """Processes the kernel's OOM killer has killed since boot (/proc/vmstat; None where unknown).

    Machine-wide, so an OOM kill elsewhere during a step also counts: at worst that makes innocent
    ops suspects, which then run alone once and go on (control/control.py)."""
    try:
        with open("/proc/vmstat") as f:
            for line in f:
                if line.startswith("oom_kill "):
                    return int(line.split()[1])
    except OSError:
        pass
    return None

