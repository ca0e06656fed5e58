"""The scheduler's training steps across runs (Scheduler._together): forward_backward ops of several
runs go into one step under a token budget, one per run, in turn order; heads that cannot join keep
their turn; each run's ops stay in seq_id order. No torch, no engine."""

from __future__ import annotations

import threading
import time

import numpy as np

from tinkerd.control.queue import OpQueue
from tinkerd.control.scheduler import LANE_TRAIN, Scheduler
from tinkerd.types import AdamParams, Datum, ForwardBackwardOp, OptimStepOp

from tests.unit.control.test_scheduler import put, sample_op


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


def _pass_of_three_then(sched: Scheduler, q: OpQueue, c_next=None, pass_s: float = 10.0) -> None:
    """Runs a, b, c share a pass that took `pass_s` (so the wait is at most a tenth of it); then a and
    b send their next forward_backward (and c `c_next`, if given)."""
    for run in "abc":
        put(q, f"{run}0", run, 0, fb(run))
    picked = sched.next(active_rows=0)
    assert [o.request_id for o in picked.ops] == ["a0", "b0", "c0"]
    sched.charge(picked, pass_s)
    for run in "ab":
        put(q, f"{run}1", run, 1, fb(run))
    if c_next is not None:
        put(q, "c1", "c", 1, c_next)


def test_a_pass_waits_for_the_run_of_the_last_pass_whose_next_op_is_on_its_way():
    q = OpQueue()
    sched = Scheduler(q, batch_tokens=1000, batch_wait_s=5.0)
    _pass_of_three_then(sched, q)
    # c's client sends its forward_backward 50 ms later: it joins the pass instead of taking its own.
    late = threading.Timer(0.05, lambda: put(q, "c1", "c", 1, fb("c")))
    late.start()
    started = time.monotonic()
    picked = sched.next(active_rows=0)
    waited = time.monotonic() - started
    late.join()
    assert [o.request_id for o in picked.ops] == ["a1", "b1", "c1"]
    assert 0.04 < waited < 0.6  # as soon as c's op is in, not the whole wait (1 s: a tenth of the pass)


def test_the_wait_is_bounded_by_a_tenth_of_the_last_pass_and_skipped_when_nothing_is_missing():
    q = OpQueue()
    sched = Scheduler(q, batch_tokens=1000, batch_wait_s=5.0)
    _pass_of_three_then(sched, q, pass_s=2.0)
    started = time.monotonic()  # c's client stopped: waited for once, a tenth of the 2 s pass
    assert [o.request_id for o in sched.next(active_rows=0).ops] == ["a1", "b1"]
    assert 0.19 < time.monotonic() - started < 1.5
    # c's next op is queued and cannot join (its optim_step): nothing is on its way, no wait.
    q = OpQueue()
    sched = Scheduler(q, batch_tokens=1000, batch_wait_s=5.0)
    _pass_of_three_then(sched, q, c_next=OptimStepOp("c", AdamParams()))
    started = time.monotonic()
    assert [o.request_id for o in sched.next(active_rows=0).ops] == ["a1", "b1"]
    assert time.monotonic() - started < 0.5  # a wait would have been 1 s


def test_no_wait_while_sampling_rows_decode_or_when_it_is_off():
    for wait_s, rows in ((5.0, 1), (0.0, 0)):
        q = OpQueue()
        sched = Scheduler(q, batch_tokens=1000, batch_wait_s=wait_s)
        _pass_of_three_then(sched, q)
        started = time.monotonic()
        picked = sched.next(active_rows=rows)
        while picked.lane != LANE_TRAIN:  # with rows in flight, lanes alternate
            sched.charge(picked, 0.0)
            picked = sched.next(active_rows=rows)
        assert [o.request_id for o in picked.ops] == ["a1", "b1"]
        assert time.monotonic() - started < 0.5  # a wait would have been 1 s


def test_a_sampling_request_ends_the_wait():
    q = OpQueue()
    sched = Scheduler(q, batch_tokens=1000, batch_wait_s=5.0)
    _pass_of_three_then(sched, q)
    threading.Timer(0.02, lambda: put(q, "s0", "m", None, sample_op())).start()
    started = time.monotonic()
    picked = sched.next(active_rows=0)
    assert [o.request_id for o in picked.ops] == ["a1", "b1"]
    assert time.monotonic() - started < 0.5  # not the 1 s the pass allowed


def opt(model: str, base: str = "base-a") -> OptimStepOp:
    return OptimStepOp(model, AdamParams(), base_model=base)


def test_optim_steps_of_several_runs_on_one_base_model_share_a_step():
    q = OpQueue()
    put(q, "a0", "a", 0, opt("a"))
    put(q, "a1", "a", 1, opt("a"))
    put(q, "b0", "b", 0, fb("b"))
    put(q, "c0", "c", 0, opt("c"))
    put(q, "d0", "d", 0, opt("d", base="base-b"))
    put(q, "e0", "e", 0, opt("e", base=""))  # a record from before base_model: its engine is unknown
    put(q, "f0", "f", 0, opt("f"))
    sched = Scheduler(q, batch_tokens=100)
    # a0 takes c0 and f0, the optim_steps at the heads of base-a's other runs; a1 waits for a's next
    # turn, b's forward_backward and the optim_steps of base-b and of no known base keep their places.
    assert steps(sched, 5) == [["a0", "c0", "f0"], ["b0"], ["d0"], ["e0"], ["a1"]]
    assert q.depth() == 0


def test_without_a_budget_optim_steps_go_one_a_step():
    q = OpQueue()
    for run in "ab":
        put(q, f"{run}0", run, 0, opt(run))
    assert steps(Scheduler(q), 2) == [["a0"], ["b0"]]
