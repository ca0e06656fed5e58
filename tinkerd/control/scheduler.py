"""The scheduler: picks what each engine step does.

Two kinds of work share one engine and its one worker thread:
- the `train` lane: ops that run to completion in one step (forward_backward, optim_step, save,
  load, create), seconds each on CPU for a real batch;
- the `sample` lane: requests that join the engine's continuous decode batch; a sampling step
  admits waiting requests and advances every in-flight row by one token (~50 ms for 8 rows of
  SmolLM2-135M on one core).

Policy, a fair share of engine time: when both lanes have work, the lane that has used less engine
time goes next. A lane with no work banks no credit (its account is raised to the other's), so
coming back from idle it cannot hold the engine for long. Both busy: ~half the time each, so a 3 s
forward_backward is followed by ~3 s of decode steps, and neither starves; one idle: the other
gets all of it. A training step carries one op, or several runs' (below), per engine (an
EngineRouter of several: Ray actors of different base models train at once); a sampling step admits every waiting request that
fits the row budget, round-robin over sampling sessions, then decodes.

Training across tenants (`_together`): when the step's op is a forward_backward (or a forward), the
heads of other runs' queues that are forward_backward ops too (same base model, both forward or
both not) join it, one per run, in round-robin order, while the step's tokens stay within
`batch_tokens`; the engine runs them as one pass over the base model (engine/cotrain.py), each
result equal to its op alone. A joined run has had its turn (it goes to the back of the line, as
if it had been picked); a head that cannot join (an optim_step, a save, an op over the budget) keeps
its place and goes first in a later step. So no run waits for more than one turn, and each run's
ops still run one at a time in seq_id order.

An optim_step takes the queued optim_steps of other runs on its base model into its step too
(`_optim_steps`), under the same switch (`batch_tokens` > 0) and turn rule: the runs of a shared
pass then get their optim_step results at once and send their next forward_backward together,
where one by one each step's round trip through control (~15 ms on SmolLM2) put the last run's
op further behind the others, past the wait below (4 tenants of 1 x 32 tokens: 1.12 passes per
round). Each optim_step still runs as it would alone (engine/cotrain.py runs them in turn).

A pass also waits a moment for a run of the previous pass whose client has not sent its next op
yet (`_together`'s wait): an SDK loop sends its forward_backward once its optim_step's result is
back, so the run whose optim_step ran last in a round is still on its way (tens of ms) when the
others' forward_backward ops start the next pass, and it then takes a pass of its own (4 tenants of
1 x 32 tokens on SmolLM2: 6 passes per 4 rounds instead of 4). The wait ends as soon as every such
run's op is in, and lasts at most `batch_wait_s` and a tenth of the last shared pass; it is skipped
while sampling rows decode, and a sampling request that comes meanwhile ends it. A run whose client
stopped is waited for once: it is not in the pass that then runs.

Suspects (control/control.py): ops that were in flight when the engine died of what it was doing
run apart from everything else: rows in flight decode to their end with nothing admitted beside
them, then a training suspect runs alone, or the sampling suspects that died only once are admitted
together (a crash is most often one training op, and its batch-mates should not then decode one by
one); a sampling suspect that died twice runs alone. A death of a suspect alone names its cause.

Quotas (control/quotas.py): an op whose account is over a quota is passed over, not failed (and
retrieve_future asks `pause_reason` for its queue_state). When every queued op is paused and no
rows decode, the scheduler sleeps until a token leaves a window (or a recheck, or new work).

Withdrawn ops (a queued sample cancelled by its client, queue.py) wake an idle scheduler: it then
picks an empty step, so the worker stores their outcome (control.py) with nothing for the engine.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass
from typing import Any

from tinkerd.control.queue import OpQueue, QueuedOp
from tinkerd.control.quotas import Quotas
from tinkerd.types import ForwardBackwardOp, OptimStepOp, SampleOp, StepBatch

LANE_TRAIN = "train"
LANE_SAMPLE = "sample"


@dataclass
class Picked:
    batch: StepBatch
    # The queued ops this step carries (their request_id is the ticket), for their finalize.
    ops: list[QueuedOp]
    lane: str
    # Lanes with no work when this step was picked: they bank no credit for its time.
    idle: tuple[str, ...] = ()
    # A forward_backward step: (base model, the runs whose ops it carries), for the next one's wait.
    pass_of: tuple[str, frozenset[str]] | None = None


class Scheduler:
    def __init__(self, queue: OpQueue, max_rows: int = 64, quotas: Quotas | None = None,
                 suspects: Mapping[str, int] | None = None, engine_of: Callable[[Any], Hashable | None] | None = None,
                 batch_tokens: int = 0, batch_wait_s: float = 0.0):
        self.queue = queue
        # Longest wait for a run of the last shared pass that has nothing queued (module docstring;
        # ServerConfig.train_batch_wait_ms). 0: never wait.
        self.batch_wait_s = batch_wait_s
        # base model -> (the runs of its last training pass, that step's seconds).
        self._last_pass: dict[str, tuple[frozenset[str], float]] = {}
        # Most tokens (datum tokens of every op) a training step of several runs' forward_backward ops
        # carries (ServerConfig.train_batch_tokens); its first op goes whatever its size. 0: one op.
        self.batch_tokens = batch_tokens
        # The engine an op will run on (EngineRouter.engine_key), None where unknown: a training step
        # then carries one op per engine, so engines of different base models (Ray actors) train at
        # the same time. None (one engine): one training op per step.
        self.engine_of = engine_of
        # request_id -> engine deaths it was in flight for, of suspect ops queued or in flight (the
        # control plane keeps them).
        self.suspects: Mapping[str, int] = suspects if suspects is not None else {}
        # None: no account is ever paused (unit tests, internal use).
        self.quotas = quotas
        # Sampling rows in flight beyond which new requests wait. Decode cost grows about linearly
        # past ~8-16 rows on CPU (matmuls turn compute-bound), and every row holds its KV cache;
        # a request with more samples than this still runs, alone, when the batch is empty.
        self.max_rows = max_rows
        self.used_s = {LANE_TRAIN: 0.0, LANE_SAMPLE: 0.0}

    @staticmethod
    def lane_of(op: Any) -> str:
        return LANE_SAMPLE if isinstance(op, SampleOp) else LANE_TRAIN

    def next(self, active_rows: int) -> Picked | None:
        """The next step. Blocks only while the engine is idle and nothing queued may start; None once closed."""
        eligible = self._eligible if self.quotas is not None else None
        while True:
            seen = self.queue.puts
            if active_rows == 0 and not self.queue.wait():
                return None
            if self.queue.closed:
                return None
            if self.quotas is not None:
                self.quotas.new_pass()
            train = self.queue.has(LANE_TRAIN, eligible)
            sample = active_rows > 0 or self.queue.has(LANE_SAMPLE, eligible)
            if train or sample:
                break
            if self.queue.has_withdrawn():  # only cancelled ops to store: a step with no engine work
                return Picked(StepBatch(), [], LANE_SAMPLE)
            # Everything queued is paused by a quota: sleep until budget may have come back.
            self.queue.wait_for_put(seen, self.quotas.recheck_s())
        if self.suspects and (picked := self._isolated(active_rows, eligible)) is not None:
            return picked
        idle = tuple(lane for lane, busy in ((LANE_TRAIN, train), (LANE_SAMPLE, sample)) if not busy)
        if train and (not sample or self.used_s[LANE_TRAIN] <= self.used_s[LANE_SAMPLE]):
            q = self.queue.pop(LANE_TRAIN, eligible=eligible)
            if q is not None:
                self._started(q)
                together = (self._optim_steps(q, eligible) if isinstance(q.op.op, OptimStepOp)
                            else self._together(q, eligible, wait=not sample))
                ops = [q, *together, *self._beside(q, eligible)]
                pass_of = None
                if isinstance(q.op.op, ForwardBackwardOp) and q.op.op.base_model:
                    pass_of = (q.op.op.base_model, frozenset(o.target for o in (q, *together)))
                return Picked(StepBatch(run=[(o.request_id, o.op.op) for o in ops]), ops, LANE_TRAIN, idle, pass_of)
        admitted = self._admit(active_rows)
        batch = StepBatch(admit=[(q.request_id, q.op.op) for q in admitted], decode=True)
        return Picked(batch, admitted, LANE_SAMPLE, idle)

    def _isolated(self, active_rows: int, eligible) -> Picked | None:
        """The next step while suspects exist; None when none may start (all paused by a quota)."""
        if active_rows > 0:  # a suspect decoding alone, or others' rows draining first: admit nothing
            return Picked(StepBatch(decode=True), [], LANE_SAMPLE)

        def suspect(deaths: int | None):
            def check(q: QueuedOp) -> bool:
                n = self.suspects.get(q.request_id)
                return n is not None and (deaths is None or n == deaths) and (eligible is None or eligible(q))
            return check

        q = self.queue.pop(LANE_TRAIN, eligible=suspect(None))
        if q is not None:
            self._started(q)
            return Picked(StepBatch(run=[(q.request_id, q.op.op)]), [q], LANE_TRAIN)
        admitted = self._admit(0, suspect(1))
        if not admitted and (q := self.queue.pop(LANE_SAMPLE, eligible=suspect(None))) is not None:
            self._started(q)
            admitted = [q]
        if not admitted:
            return None
        return Picked(StepBatch(admit=[(q.request_id, q.op.op) for q in admitted], decode=True), admitted, LANE_SAMPLE)

    def _together(self, first: QueuedOp, eligible, wait: bool = False) -> list[QueuedOp]:
        """Other runs' forward_backward ops to share `first`'s pass (module docstring), in turn order;
        `wait`: also those of the last pass's runs that arrive within the wait."""
        op = first.op.op
        if self.batch_tokens <= 0 or not isinstance(op, ForwardBackwardOp) or not op.base_model:
            return []
        tokens = _tokens(op)
        taken = {first.target}

        def joins(q: QueuedOp) -> bool:
            other = q.op.op
            return (isinstance(other, ForwardBackwardOp) and q.target not in taken
                    and other.base_model == op.base_model and other.forward_only == op.forward_only
                    and tokens + _tokens(other) <= self.batch_tokens and q.request_id not in self.suspects
                    and (eligible is None or eligible(q)))

        def took(q: QueuedOp) -> None:
            nonlocal tokens
            taken.add(q.target)
            tokens += _tokens(q.op.op)

        together = self._take(joins, took)
        last, last_s = self._last_pass.get(op.base_model, (frozenset(), 0.0))
        deadline = time.monotonic() + min(self.batch_wait_s, last_s / 10)
        while wait and tokens < self.batch_tokens and (left := deadline - time.monotonic()) > 0:
            seen = self.queue.puts  # before the check: a put right after it still ends the wait
            # Runs of the last pass with nothing queued: their client holds their next op. A sampling
            # request that comes meanwhile ends the wait: decode is not held up for a fuller pass.
            if (self.queue.closed or self.queue.has(LANE_SAMPLE)
                    or not any(self.queue.depth(target) == 0 for target in last - taken)):
                break
            self.queue.wait_for_put(seen, left)
            together += self._take(joins, took)
        return together

    def _optim_steps(self, first: QueuedOp, eligible) -> list[QueuedOp]:
        """Other runs' optim_steps on `first`'s base model that are the heads of their queues, in
        turn order, to run in `first`'s step (module docstring)."""
        base_model = first.op.op.base_model
        if self.batch_tokens <= 0 or not base_model:  # "" (a record from before the field): engine unknown
            return []
        taken = {first.target}

        def joins(q: QueuedOp) -> bool:
            return (isinstance(q.op.op, OptimStepOp) and q.op.op.base_model == base_model
                    and q.target not in taken and q.request_id not in self.suspects
                    and (eligible is None or eligible(q)))

        return self._take(joins, lambda q: taken.add(q.target))

    def _take(self, joins: Callable[[QueuedOp], bool], took: Callable[[QueuedOp], None]) -> list[QueuedOp]:
        """The train lane's queue heads that `joins` accepts, in turn order, each started; took(op)
        after each, so `joins` sees it before the next."""
        out = []
        while (q := self.queue.pop(LANE_TRAIN, eligible=joins)) is not None:
            self._started(q)
            took(q)
            out.append(q)
        return out

    def _beside(self, first: QueuedOp, eligible) -> list[QueuedOp]:
        """Training ops for the other engines, one each, to run in the same step as `first`."""
        if self.engine_of is None or (key := self.engine_of(first.op.op)) is None:
            return []
        taken = {key}

        def elsewhere(q: QueuedOp) -> bool:
            k = self.engine_of(q.op.op)
            return k is not None and k not in taken and (eligible is None or eligible(q))

        return self._take(elsewhere, lambda q: taken.add(self.engine_of(q.op.op)))

    def charge(self, picked: Picked, seconds: float) -> None:
        """Book a finished step's engine time to its lane; lanes idle meanwhile keep level, not behind."""
        self.used_s[picked.lane] += seconds
        if picked.pass_of is not None:
            self._last_pass[picked.pass_of[0]] = (picked.pass_of[1], seconds)
        for lane in picked.idle:
            self.used_s[lane] = max(self.used_s[lane], self.used_s[picked.lane])

    def pause_reason(self, request_id: str) -> str | None:
        """Why a queued op waits on a quota now (its own, or that of the op ahead of it in its
        target's seq_id order), or None: not queued any more, or free to start at its turn."""
        head = self.queue.head_of(request_id) if self.quotas is not None else None
        if head is None:
            return None
        return self.quotas.pause_reason(head.request_type, head.target, head.seq_id, head.op, fresh=True)

    def _eligible(self, q: QueuedOp) -> bool:
        return self.quotas.pause_reason(q.request_type, q.target, q.seq_id, q.op) is None

    def _started(self, q: QueuedOp) -> None:
        if self.quotas is not None:
            self.quotas.started(q.request_id, q.op)

    def _admit(self, active_rows: int, eligible=None) -> list[QueuedOp]:
        """Waiting sampling requests that fit beside `active_rows`, round-robin (with `eligible`:
        only those it passes; by default those no quota pauses)."""
        rows = active_rows
        admitted: list[QueuedOp] = []
        if eligible is None and self.quotas is not None:
            eligible = self._eligible

        def fits(q: QueuedOp) -> bool:
            return rows == 0 or rows + q.op.op.num_samples <= self.max_rows

        # Each admission is charged before the next is looked at: one account's burst of requests
        # cannot all start on the budget that one of them fits in.
        while (q := self.queue.pop(LANE_SAMPLE, fits, eligible)) is not None:
            self._started(q)
            admitted.append(q)
            rows += q.op.op.num_samples
        return admitted


def _tokens(op: ForwardBackwardOp) -> int:
    return sum(len(d.tokens) for d in op.data)
