"""The hot queue: in memory, one ordered queue per target, round-robin across targets, per lane.

A target is a training model (ops run in seq_id order: the SDK numbers them in submission order and
gradients must accumulate in that order) or a sampling session. Round-robin means one tenant's long
queue never starves another's single op: each turn takes at most one op per target.

Lanes separate kinds of work the scheduler weighs against each other (`train`: ops that run to
completion in one engine step; `sample`: requests that join the decode batch). The queue only keeps
them apart; which lane goes next is the scheduler's policy. Durability is the store's job; this
queue is rebuilt from pending futures after a restart.
"""

from __future__ import annotations

import heapq
import itertools
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable


@dataclass(order=True)
class QueuedOp:
    seq_id: int
    arrival: int
    request_id: str = field(compare=False)
    target: str = field(compare=False)
    request_type: str = field(compare=False)
    op: Any = field(compare=False)


class OpQueue:
    def __init__(self, lane_of: Callable[[Any], str] | None = None) -> None:
        # Which lane an op goes to when `put` names none (every op is "train" without it); set
        # here, not by each caller, so a later re-queue after a restart cannot misfile an op.
        self._lane_of = lane_of
        # lane -> target -> heap of its ops; a target's position in the OrderedDict is its turn.
        self._lanes: dict[str, OrderedDict[str, list[QueuedOp]]] = {}
        self._cond = threading.Condition()
        self._arrival = itertools.count()
        self._closed = False

    def put(
        self, request_id: str, target: str, seq_id: int | None, request_type: str, op: Any, lane: str | None = None
    ) -> None:
        if lane is None:
            lane = self._lane_of(op) if self._lane_of is not None else "train"
        with self._cond:
            n = next(self._arrival)
            item = QueuedOp(seq_id if seq_id is not None else n, n, request_id, target, request_type, op)
            heapq.heappush(self._lanes.setdefault(lane, OrderedDict()).setdefault(target, []), item)
            self._cond.notify()

    def wait(self, timeout_s: float | None = None) -> bool:
        """Block until some lane holds an op; False when closed (or on timeout with nothing queued)."""
        with self._cond:
            while not self._closed and not self._any():
                if not self._cond.wait(timeout_s):
                    break
            return not self._closed and self._any()

    def pop(self, lane: str, fits: Callable[[QueuedOp], bool] | None = None) -> QueuedOp | None:
        """The head of the next target in `lane`'s round-robin order, or None; never blocks.

        With `fits`, that head is taken only if fits(head) (checked and taken under one lock).
        """
        with self._cond:
            targets = self._lanes.get(lane)
            if self._closed or not targets:
                return None
            target, heap = next(iter(targets.items()))
            if fits is not None and not fits(heap[0]):
                return None
            item = heapq.heappop(heap)
            # Rotate: this target goes to the back of the line.
            del targets[target]
            if heap:
                targets[target] = heap
            return item

    def has(self, lane: str) -> bool:
        with self._cond:
            return bool(self._lanes.get(lane))

    @property
    def closed(self) -> bool:
        return self._closed

    def depth(self, target: str | None = None) -> int:
        with self._cond:
            if target is not None:
                return sum(len(t.get(target, ())) for t in self._lanes.values())
            return sum(len(q) for t in self._lanes.values() for q in t.values())

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def _any(self) -> bool:
        return any(self._lanes.values())
