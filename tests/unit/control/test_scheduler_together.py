"""The scheduler's training steps across runs (Scheduler._together): forward_backward ops of several
runs go into one step under a token budget, one per run, in turn order; heads that cannot join keep
their turn; each run's ops stay in seq_id order. No torch, no engine."""

from __future__ import annotations

import numpy as np

from tinkerd.control.queue import OpQueue
from tinkerd.control.scheduler import LANE_TRAIN, Scheduler
from tinkerd.types import AdamParams, Datum, ForwardBackwardOp, OptimStepOp

from tests.unit.control.test_scheduler import put


def fb(model: str, tokens: int = 100, forward_only: bool = False, base: str = "base-a") -> ForwardBackwardOp:
    datum = Datum(tokens=np.zeros(tokens, np.int64), loss_fn_inputs={"target_tokens": np.zeros(tokens, np.int64)})
    return ForwardBackwardOp(model, [datum], "cross_entropy", forward_only=forward_only, base_model=base)


def steps(sched: Scheduler, n: int) -> list[list[str]]:
    out = []
    for _ in range(n):
        picked = sched.next(active_rows=0)
        assert picked.lane == LANE_TRAIN
        assert [t for t, _ in picked.batch.run] == [q.request_id for q in picked.ops]
        out.append([q.request_id for q in picked.ops])
        sched.charge(picked, 1.0)
    return out


def test_forward_backward_ops_of_several_runs_share_a_step_under_the_token_budget():
    q = OpQueue()
    for seq in range(2):
        for run in "abcd":
            put(q, f"{run}{seq}", run, seq, fb(run))
    sched = Scheduler(q, batch_tokens=300)
    # 3 x 100 tokens fit; d0 would make 400. d keeps its place and opens the next step, whose
    # budget the runs that went first then fill again, each with its next op in seq_id order.
    assert steps(sched, 3) == [["a0", "b0", "c0"], ["d0", "a1", "b1"], ["c1", "d1"]]
    assert q.depth() == 0


def test_without_a_budget_a_step_carries_one_op():
    q = OpQueue()
    for run in "ab":
        put(q, f"{run}0", run, 0, fb(run))
    assert steps(Scheduler(q), 2) == [["a0"], ["b0"]]  # batch_tokens=0, the Scheduler's default


def test_heads_that_cannot_join_keep_their_turn():
    q = OpQueue()
    put(q, "a0", "a", 0, fb("a"))
    put(q, "b0", "b", 0, OptimStepOp("b", AdamParams(), base_model="base-a"))
    put(q, "b1", "b", 1, fb("b"))
    put(q, "c0", "c", 0, fb("c", forward_only=True))
    put(q, "d0", "d", 0, fb("d", base="base-b"))
    put(q, "e0", "e", 0, fb("e", tokens=1000))
    put(q, "f0", "f", 0, fb("f"))
    put(q, "g0", "g", 0, fb("g", forward_only=True))
    sched = Scheduler(q, batch_tokens=500)
    # a0 opens; b's optim_step, c's forward, d's other base model and e's 1000 tokens cannot join and
    # keep their places in front; f0 joins. Then b0 (an optim_step goes alone), c0 with g0 (two
    # forwards), d0, and e0, which goes whatever its size as a step's first op, with nothing beside
    # it; b1 waited behind b0 throughout.
    assert steps(sched, 6) == [["a0", "f0"], ["b0"], ["c0", "g0"], ["d0"], ["e0"], ["b1"]]
    assert q.depth() == 0


def test_a_run_never_waits_more_than_one_step_behind_a_busy_neighbour():
    """Run a queues 30 ops, b one op every step: every op of a starts in a step of its own turn."""
    q = OpQueue()
    for seq in range(30):
        put(q, f"a{seq}", "a", seq, fb("a", tokens=200))
    sched = Scheduler(q, batch_tokens=1000)
    started = []
    for seq in range(30):
        put(q, f"b{seq}", "b", seq, fb("b", tokens=200))
        picked = sched.next(active_rows=0)
        sched.charge(picked, 1.0)
        started.append([o.request_id for o in picked.ops])
    # One op of each run per step, each run's ops in seq_id order.
    assert all(sorted(s) == [f"a{i}", f"b{i}"] for i, s in enumerate(started)), started


def test_suspects_and_paused_ops_do_not_join():
    q = OpQueue()
    for run in "abc":
        put(q, f"{run}0", run, 0, fb(run))
    sched = Scheduler(q, batch_tokens=1000, suspects={"b0": 1})
    picked = sched.next(active_rows=0)  # the suspect first, alone (control/scheduler.py: _isolated)
    assert [o.request_id for o in picked.ops] == ["b0"]
    sched.suspects = {}
    assert [o.request_id for o in sched.next(active_rows=0).ops] == ["a0", "c0"]
