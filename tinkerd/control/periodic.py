"""A background chore run every `interval_s` on a daemon thread of its own: the future retention
sweep (retention.py), the checkpoint sweeper (checkpoints.py) and the pause board (pauses.py).

A tick that raises is logged and the next one runs: storage unavailable for a while (PostgreSQL
restarting, a full disk) or a bug in one sweep must not end the chore for the process's lifetime.
"""

from __future__ import annotations

import logging
import threading

from tinkerd.errors import TinkerdError

log = logging.getLogger(__name__)


class Periodic:
    thread_name = "tinkerd-periodic"
    tick_first = False  # run a tick at start, before the first wait

    def __init__(self, interval_s: float):
        self.interval_s = interval_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def tick(self) -> None:
        raise NotImplementedError

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name=self.thread_name, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)

    def _run(self) -> None:
        if self.tick_first:
            self._tick()
        while not self._stop.wait(self.interval_s):
            self._tick()

    def _tick(self) -> None:
        try:
            self.tick()
        except TinkerdError as e:  # storage unavailable: the next tick retries
            log.warning("%s failed: %s; retrying", self.thread_name, e.message)
        except Exception:  # noqa: BLE001  the chore must outlive any bug
            log.exception("%s failed", self.thread_name)
