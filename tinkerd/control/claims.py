"""The engine driver's claims on ops that api replicas accepted (docs/deployment.md).

An api replica (`tinkerd serve --role api`) stores an accepted op in the log with no claim and sends
a `work` notification; it has no queue. The driver (`--role worker`) takes unclaimed pending ops with
`SELECT ... FOR UPDATE SKIP LOCKED` (store/futures.py: FutureRepository.claim), marks them its own in
the same transaction, and puts them in its in-memory queue, where they run exactly as if submitted
to it; ops submitted to the driver itself are claimed at submit. The log stays the durable queue and
the hot queue stays in memory (docs/architecture.md, house style).

A claim pass runs on each notification and at least every `poll_s` (1 s): a notification missed while
the listener was reconnecting (a PostgreSQL restart) delays an op by at most that long. The SDK
numbers a run's ops and sends the next only after the previous one is accepted (its turn lock), so a
claim in accepted order hands the queue each run's ops in seq_id order; the queue orders by seq_id
anyway.
"""

from __future__ import annotations

import logging
import threading
from typing import Callable

from tinkerd.control.store.futures import FutureRepository
from tinkerd.control.store.tables import FutureRow
from tinkerd.errors import TinkerdError

log = logging.getLogger(__name__)

POLL_S = 1.0


class Claimer:
    def __init__(self, futures: FutureRepository, worker_id: str, take: Callable[[FutureRow], None],
                 poll_s: float = POLL_S):
        self.futures = futures
        self.worker_id = worker_id
        # take(row): rebuild the op from its record and queue it, or store it failed (Control._take).
        self._take = take
        self._poll_s = poll_s
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.claimed = 0

    def wake(self) -> None:
        """From the notifier's thread: ops are waiting."""
        self._wake.set()

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="tinkerd-claims", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=10)

    def claim_once(self) -> int:
        rows = self.futures.claim(self.worker_id)
        for row in rows:
            self._take(row)
        self.claimed += len(rows)
        return len(rows)

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(self._poll_s)
            self._wake.clear()
            if self._stop.is_set():
                return
            try:
                while self.claim_once():  # a full batch may leave more behind it
                    pass
            except TinkerdError as e:  # storage unavailable (PostgreSQL restarting): next pass retries
                log.warning("claiming work failed: %s; retrying", e.message)
            except Exception:  # noqa: BLE001  the claimer must outlive any bug
                log.exception("claiming work failed")
