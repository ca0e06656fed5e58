"""The engine driver's quota pauses, posted for api replicas (docs/deployment.md).

On one process, retrieve_future asks the scheduler why a pending op waits (scheduler.pause_reason:
its account's quota, control/quotas.py) and answers `paused_rate_limit` with that reason. An api
replica has no queue and no quota windows (they live in the driver, which sees every account's ops):
it reads the reason the driver last posted in the op's row (`futures.paused_reason`).

The driver's board asks its scheduler the same question for every queued op every `interval_s`
(0.5 s) and writes only what changed, in one transaction: nothing while nothing is paused, one write
when a pause starts or ends. A replica's answer lags the driver's by at most that interval plus a
write; its long-poll hold is 20 s by default, so the answer after a hold is as current as the
driver's own. An op that leaves the queue (it starts, or is withdrawn) has its reason cleared.
"""

from __future__ import annotations

from tinkerd.control.periodic import Periodic
from tinkerd.control.queue import OpQueue
from tinkerd.control.scheduler import Scheduler
from tinkerd.control.store.futures import FutureRepository

INTERVAL_S = 0.5


class PauseBoard(Periodic):
    thread_name = "tinkerd-pauses"

    def __init__(self, futures: FutureRepository, queue: OpQueue, scheduler: Scheduler,
                 interval_s: float = INTERVAL_S):
        super().__init__(interval_s)
        self.futures = futures
        self.queue = queue
        self.scheduler = scheduler
        # request_id -> the reason last written for it (only ops posted as paused).
        self._posted: dict[str, str] = {}

    def post_once(self) -> int:
        """Write the pauses that changed since the last post; how many rows changed."""
        now = {}
        for ops in self.queue.lanes().values():
            for q in ops:
                reason = self.scheduler.pause_reason(q.request_id)
                if reason is not None:
                    now[q.request_id] = reason
        changes: dict[str, str | None] = {rid: r for rid, r in now.items() if self._posted.get(rid) != r}
        changes.update({rid: None for rid in self._posted if rid not in now})
        if changes:
            self.futures.post_pauses(changes)
        self._posted = now
        return len(changes)

    def tick(self) -> None:
        self.post_once()
