"""Back-pressure: the queue's budget, and the SDK's rate-limit answer to new work beyond it.

Without a bound, a client that pipelines faster than the engine trains (or many clients at once)
grows the in-memory queue (queue.py) without limit: every queued op holds its datums. With one, a
new op whose target (a training run or a sampling session) already has `per_target` ops waiting,
or that finds `total` ops waiting on the server, is refused before it is stored: HTTP 429 with
Retry-After (errors.QueueFull). The tinker SDK retries a 429 (its HTTP client honours a Retry-After
of up to 60 s, 10 times; its training calls then back off 1 s doubling to 30 s for 5 minutes), and
it sends a training run's ops one at a time in seq_id order, each waiting for its predecessor to be
accepted, so a refusal delays that run's later ops without reordering them.

Nothing accepted is ever dropped: the budget is checked only for new work (an idempotent re-send
of an accepted op returns its future first, Control.submit), never for ops re-queued by recovery
or control's own internal ops. Only ops waiting count, not those in the engine: a target whose op
is running can queue `per_target` more. The check and the put are not one atomic step, so
concurrent submissions can overshoot a budget by the number of requests in flight at that moment.

With replicas (docs/deployment.md) no process's queue holds every waiting op: an api replica queues
nothing and the driver's queue lacks what it has not claimed yet. There the budget counts the
database's pending ops instead (`count`: store/futures.py, FutureRepository.pending_count): unclaimed,
waiting in the driver's queue, and in its engine. So a replica refuses exactly when the one server
would, except that a target's op in the engine counts too (the replica cannot tell it from one
waiting): over the same budget a run whose op is running can queue one op fewer.
"""

from __future__ import annotations

from collections.abc import Callable

from tinkerd.control.queue import OpQueue
from tinkerd.errors import QueueFull


class QueueBudget:
    def __init__(self, per_target: int | None, total: int | None,
                 count: Callable[[str | None], int] | None = None):
        # None: no bound.
        self.per_target = per_target
        self.total = total
        # count(target or None) -> ops waiting, where the queue does not hold them all (replicas:
        # the database's pending ops); None counts the queue's.
        self.count = count

    def check(self, queue: OpQueue, target: str, on_refused: Callable[[str], None] | None = None) -> None:
        """Raise QueueFull when a new op of `target` would go over a budget; `on_refused(scope)` first."""
        depth = self.count or queue.depth
        if self.per_target is not None and depth(target) >= self.per_target:
            scope, why = "target", f"{target} already has {self.per_target} ops waiting (--max-queued-ops-per-model)"
        elif self.total is not None and depth(None) >= self.total:
            scope, why = "server", f"the server already has {self.total} ops waiting (--max-queued-ops)"
        else:
            return
        if on_refused is not None:
            on_refused(scope)
        raise QueueFull(f"not accepted: {why}; retry after {QueueFull.retry_after_s} s")
