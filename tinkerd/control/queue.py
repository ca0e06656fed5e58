"""The hot queue: in memory, one ordered queue per target, round-robin across targets.

A target is a training model (ops run in seq_id order: the SDK numbers them in submission order and
gradients must accumulate in that order) or a sampling session. Round-robin means one tenant's
long queue never starves another's single op: each turn takes at most one batch per target.
Durability is the store's job; this queue is rebuilt from pending futures after a restart.
"""

from __future__ import annotations

import heapq
import itertools
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any


@dataclass(order=True)
class QueuedOp:
    seq_id: int
    arrival: int
    request_id: str = field(compare=False)
    target: str = field(compare=False)
    request_type: str = field(compare=False)
    op: Any = field(compare=False)


class OpQueue:
    def __init__(self) -> None:
        self._queues: OrderedDict[str, list[QueuedOp]] = OrderedDict()
        self._cond = threading.Condition()
        self._arrival = itertools.count()
        self._closed = False

    def put(self, request_id: str, target: str, seq_id: int | None, request_type: str, op: Any) -> None:
        with self._cond:
            n = next(self._arrival)
            item = QueuedOp(seq_id if seq_id is not None else n, n, request_id, target, request_type, op)
            heapq.heappush(self._queues.setdefault(target, []), item)
            self._cond.notify()

    def take(self, timeout_s: float | None = None) -> list[QueuedOp] | None:
        """The next batch: the head of the next target in round-robin order. None when closed/idle."""
        with self._cond:
            while not self._closed and not self._queues:
                if not self._cond.wait(timeout_s):
                    return None
            if self._closed:
                return None
            target, heap = next(iter(self._queues.items()))
            batch = [heapq.heappop(heap)]
            # Rotate: this target goes to the back of the line.
            del self._queues[target]
            if heap:
                self._queues[target] = heap
            return batch

    def depth(self, target: str | None = None) -> int:
        with self._cond:
            if target is not None:
                return len(self._queues.get(target, ()))
            return sum(len(q) for q in self._queues.values())

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
