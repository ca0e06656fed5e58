"""The hot queue: in memory, one ordered queue per target, round-robin across targets, per lane.

A target is a training model (ops run in seq_id order: the SDK numbers them in submission order and
gradients must accumulate in that order) or a sampling session. Round-robin means one tenant's long
queue never starves another's single op: each turn takes at most one op per target.

Lanes separate kinds of work the scheduler weighs against each other (`train`: ops that run to
completion in one engine step; `sample`: requests that join the decode batch). The queue only keeps
them apart; which lane goes next is the scheduler's policy. Durability is the store's job; this
queue is rebuilt from pending futures after a restart.

A target whose head may not start yet (its account is over a quota: the scheduler's `eligible`)
keeps its place and is passed over, so the next target in turn goes; the ops behind that head wait
with it, as seq_id order requires.
"""

from __future__ import annotations

import heapq
import itertools
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable

from tinkerd.control.bookkeeping import billing
from tinkerd.control.metering import Billing
from tinkerd.control.oplog import OpRecord

# finalize(result) -> (payload bytes, media type): control's own ops (residency) and unit tests only.
Finalize = Callable[[Any], tuple[bytes, str]]


@dataclass
class Work:
    """One op as it waits and runs: the engine op, and what its success does.

    Accepted ops carry their `record` (control/oplog.py): it is what the log stores, and what
    bookkeeping.py acts on when the op succeeds. Only control's own ops have a `finalize` instead.
    """

    op: Any
    finalize: Finalize | None = None
    # Who pays and what it consumed; None records nothing (internal and test ops).
    billing: Billing | None = None
    record: OpRecord | None = None
    # When the op was accepted (perf_counter): its queue wait ends when the engine gets it.
    accepted_at: float = field(default_factory=time.perf_counter)

    @classmethod
    def of(cls, record: OpRecord) -> "Work":
        return cls(record.op, billing=billing(record), record=record)


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
        # request_id -> (lane, target), for every op still queued (not yet popped).
        self._queued: dict[str, tuple[str, str]] = {}
        self._cond = threading.Condition()
        self._arrival = itertools.count()
        # Ops taken out by `withdraw` (cancel_future), waiting for the worker to store their outcome.
        self._withdrawn: list[QueuedOp] = []
        # Bumped by every put and withdraw: a waiter that saw nothing to start sleeps until it changes.
        self.puts = 0
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
            self._queued[request_id] = (lane, target)
            self.puts += 1
            self._cond.notify_all()

    def wait(self, timeout_s: float | None = None) -> bool:
        """Block until some lane holds an op or a withdrawn op waits for the worker; False when closed
        (or on timeout with neither)."""
        with self._cond:
            while not self._closed and not self._any():
                if not self._cond.wait(timeout_s):
                    break
            return not self._closed and self._any()

    def wait_for_put(self, seen: int, timeout_s: float) -> None:
        """Block until an op is put after `puts` was `seen`, the queue closes, or the timeout."""
        with self._cond:
            self._cond.wait_for(lambda: self.puts != seen or self._closed, timeout_s)

    def pop(self, lane: str, fits: Callable[[QueuedOp], bool] | None = None,
            eligible: Callable[[QueuedOp], bool] | None = None) -> QueuedOp | None:
        """The head of the next target in `lane`'s round-robin order, or None; never blocks.

        With `eligible`, targets whose head is not eligible are passed over (they keep their turn).
        With `fits`, the chosen head is taken only if fits(head). Checked and taken under one lock.
        """
        with self._cond:
            targets = self._lanes.get(lane)
            if self._closed or not targets:
                return None
            for target, heap in targets.items():
                if eligible is None or eligible(heap[0]):
                    break
            else:
                return None
            if fits is not None and not fits(heap[0]):
                return None
            item = heapq.heappop(heap)
            del self._queued[item.request_id]
            # Rotate: this target goes to the back of the line.
            del targets[target]
            if heap:
                targets[target] = heap
            return item

    def withdraw(self, request_id: str) -> bool:
        """Take a still-queued op out of its target's queue (cancel_future) and wake the worker, which
        stores its outcome (`take_withdrawn`) like any other op's; False once it was popped."""
        with self._cond:
            where = self._queued.pop(request_id, None)
            if where is None:
                return False
            lane, target = where
            heap = self._lanes[lane][target]
            item = next(q for q in heap if q.request_id == request_id)
            heap.remove(item)
            heapq.heapify(heap)
            if not heap:
                del self._lanes[lane][target]
            self._withdrawn.append(item)
            self.puts += 1
            self._cond.notify_all()
            return True

    def take_withdrawn(self) -> list[QueuedOp]:
        """The ops withdrawn since the last call (the worker's, which fails each as cancelled)."""
        with self._cond:
            taken, self._withdrawn = self._withdrawn, []
            return taken

    def has_withdrawn(self) -> bool:
        with self._cond:
            return bool(self._withdrawn)

    def has(self, lane: str, eligible: Callable[[QueuedOp], bool] | None = None) -> bool:
        """Whether `lane` holds an op that may start (with `eligible`: a target's head that passes)."""
        with self._cond:
            targets = self._lanes.get(lane)
            if not targets:
                return False
            return eligible is None or any(eligible(heap[0]) for heap in targets.values())

    def head_of(self, request_id: str) -> QueuedOp | None:
        """The op at the head of a still-queued op's target (itself, or the one it waits behind);
        None once it was popped (or was never queued here)."""
        with self._cond:
            where = self._queued.get(request_id)
            if where is None:
                return None
            lane, target = where
            return self._lanes[lane][target][0]

    @property
    def closed(self) -> bool:
        return self._closed

    def depth(self, target: str | None = None) -> int:
        with self._cond:
            if target is not None:
                return sum(len(t.get(target, ())) for t in self._lanes.values())
            return sum(len(q) for t in self._lanes.values() for q in t.values())

    def lanes(self) -> dict[str, list[QueuedOp]]:
        """Every queued op by lane (a snapshot, for GET /metrics at scrape time)."""
        with self._cond:
            return {lane: [q for heap in targets.values() for q in heap] for lane, targets in self._lanes.items()}

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def _any(self) -> bool:
        return any(self._lanes.values()) or bool(self._withdrawn)
