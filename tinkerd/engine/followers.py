"""Ranks 1..N-1 of a ranked engine (`--engine-ranks N`, engine/sharding.py), as rank 0 sees them:
their processes and the pipe on each one's stdin that carries the StepBatches.

No torch here: rank 0 starts them first thing, before it imports torch and transformers itself
(~3 s on a quiet core), so that the N processes' imports overlap instead of following each other.
They are `python -m tinkerd.engine.sharding` processes, not `multiprocessing` ones: rank 0 is a
daemonic multiprocessing child (engine/process.py), and those may not start children of their own.
"""

from __future__ import annotations

import logging
import os
import pickle
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tinkerd.engine.process import EngineSpec

log = logging.getLogger(__name__)


class Followers:
    def __init__(self, spec: "EngineSpec"):
        import tinkerd

        self._store_dir = tempfile.mkdtemp(prefix="tinkerd-ranks-")
        # The torch.distributed rendezvous (init_method file://): a fresh file per engine start.
        self.store = str(Path(self._store_dir) / "store")
        env = dict(os.environ)
        # This very tinkerd, whatever an installed copy would resolve to in a fresh interpreter.
        root = str(Path(tinkerd.__file__).resolve().parents[1])
        env["PYTHONPATH"] = os.pathsep.join([root] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
        self.procs: list[subprocess.Popen] = []
        for rank in range(1, spec.ranks):
            proc = subprocess.Popen([sys.executable, "-m", "tinkerd.engine.sharding"], stdin=subprocess.PIPE, env=env)
            self.procs.append(proc)
            self._send(proc, (rank, spec, self.store, os.getpid()))

    def formed(self) -> None:
        """The group has met (every rank past its barrier): the rendezvous file is not needed again."""
        shutil.rmtree(self._store_dir, ignore_errors=True)

    @staticmethod
    def _send(proc: subprocess.Popen, message) -> None:
        pickle.dump(message, proc.stdin, protocol=pickle.HIGHEST_PROTOCOL)
        proc.stdin.flush()

    def send(self, message) -> None:
        """`message` to every rank, or this process ends (check) when one is gone."""
        for proc in self.procs:
            try:
                self._send(proc, message)
            except OSError:  # a broken pipe: that rank died since the last check
                self.check()
                raise

    def check(self) -> None:
        """Exit rank 0 when any other rank has died. The group is broken then (a collective with a
        dead rank fails), so the engine dies whole: control sees its process go, restarts it and
        rebuilds its runs (engine/process.py, control/recovery.py)."""
        dead = [(r, p.returncode) for r, p in enumerate(self.procs, 1) if p.poll() is not None]
        if dead:
            log.error("engine rank(s) died: %s; stopping the engine",
                      ", ".join(f"rank {r} (exit code {c})" for r, c in dead))
            self.kill()
            os._exit(1)

    def kill(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait(timeout=10)
        self.formed()

    def close(self) -> None:
        for proc in self.procs:
            try:
                proc.stdin.close()  # EOF: the rank leaves its loop and exits
            except OSError:
                pass
        for proc in self.procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
