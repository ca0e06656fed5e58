"""Per-account quotas in the control plane: the scheduler passes over an account over its tokens per
minute or its concurrent runs, serves other accounts, says why, and takes the op once budget is
back. No torch; time is a fake clock."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from tinkerd.config import ServerConfig
from tinkerd.control.accounts import Accounts
from tinkerd.control.control import Work
from tinkerd.control.metering import Billing, Usage
from tinkerd.control.queue import OpQueue
from tinkerd.control.quotas import Quotas, effective, upfront_tokens
from tinkerd.control.scheduler import Scheduler
from tinkerd.control.store.db import Store, utcnow
from tinkerd.control.store.tables import FutureRow, SessionRow, TrainingRunRow, UnloadedRunRow
from tinkerd.types import CreateModelOp, Datum, ForwardBackwardOp, LoraSpec, SampleOp, SamplingParams


class Clock:
    def __init__(self):
        self.now = 1_000_000.0

    def time(self) -> float:
        return self.now

    def monotonic(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch):
    c = Clock()
    monkeypatch.setattr("tinkerd.control.quotas.time", c)
    return c


@pytest.fixture
def store(tmp_path):
    return Store.sqlite(tmp_path / "db.sqlite")


def fb(account: str, model: str, n_tokens: int) -> Work:
    op = ForwardBackwardOp(model, [Datum(np.arange(n_tokens), {"target_tokens": np.arange(n_tokens)})], "cross_entropy")
    return Work(op, lambda r: (b"", "x"), Billing(account, "s", "tiny", lambda _: Usage(trained_tokens=n_tokens)))


def create(account: str, model: str) -> Work:
    return Work(CreateModelOp(model, "tiny", LoraSpec(4, 32.0)), lambda r: (b"", "x"), Billing(account, "s", "tiny", lambda _: Usage()))


def test_limits_and_upfront_charges():
    assert effective(None, 5) == 5 and effective(0, 5) is None and effective(7, None) == 7
    assert upfront_tokens(fb("a", "m", 12).op) == 12
    sample = SampleOp("tiny", None, np.arange(6), SamplingParams(max_tokens=4), num_samples=2)
    assert upfront_tokens(sample) == 6 + 4 * 2  # prompt + the most it can generate


def test_an_account_over_its_tokens_per_minute_waits_while_another_proceeds(store, clock):
    accounts = Accounts(store)
    slow, fast = accounts.account_id("slow"), accounts.account_id("fast")
    accounts.set_quota("slow", max_tokens_per_minute=100)  # window 60 s: 100 tokens in it
    quotas = Quotas(store, ServerConfig())
    q = OpQueue()
    sched = Scheduler(q, quotas=quotas)
    for i in range(3):  # 60 tokens each: the first fits, the second does not (60 + 60 > 100)
        q.put(f"slow-{i}", "model-slow", i + 1, "ForwardBackward", fb(slow, "model-slow", 60))
    q.put("fast-0", "model-fast", 1, "ForwardBackward", fb(fast, "model-fast", 500))
    picked = sched.next(active_rows=0)
    assert picked.ops[0].request_id == "slow-0"
    quotas.on_usage("slow-0", slow, Usage(trained_tokens=60))  # completed: its metered count replaces the charge
    assert sched.next(active_rows=0).ops[0].request_id == "fast-0"  # not over any quota: 500 in one op is fine
    assert "slow" in sched.pause_reason("slow-1") and "60 used" in sched.pause_reason("slow-1")
    assert sched.pause_reason("slow-2") == sched.pause_reason("slow-1")  # waits behind it, same reason
    assert sched.pause_reason("fast-0") is None  # no longer queued
    clock.now += 61  # slow-0's tokens leave the window
    assert sched.next(active_rows=0).ops[0].request_id == "slow-1"
    assert sched.pause_reason("slow-2") is not None
    assert quotas.window_tokens(slow) == 60 and quotas.window_tokens(fast) == 0  # slow-1's charge alone


def test_an_op_bigger_than_the_whole_budget_runs_alone_instead_of_waiting_forever(store, clock):
    accounts = Accounts(store)
    acct = accounts.account_id("tiny-budget")
    quotas = Quotas(store, ServerConfig(max_tokens_per_minute=10))  # the server-wide default applies
    q = OpQueue()
    sched = Scheduler(q, quotas=quotas)
    q.put("big-0", "m", 1, "ForwardBackward", fb(acct, "m", 50))
    q.put("big-1", "m", 2, "ForwardBackward", fb(acct, "m", 50))
    assert sched.next(active_rows=0).ops[0].request_id == "big-0"
    assert sched.pause_reason("big-1") is not None
    clock.now += 60.5
    assert sched.next(active_rows=0).ops[0].request_id == "big-1"


def _live_run(store: Store, session: str, account: str, model: str) -> None:
    now = utcnow()
    store.add(SessionRow(session_id=session, account_id=account, created_at=now, last_heartbeat_at=now))
    store.add(TrainingRunRow(model_id=model, session_id=session, base_model="tiny", lora_rank=4,
                             lora_config={"rank": 4}, created_at=now, last_request_at=now))
    store.add(FutureRow(request_id=f"create-{model}", request_type="CreateModel", target=model, seq_id=0,
                        account_id=account, body=b"", status="complete", created_at=now))


def test_a_create_over_the_run_limit_waits_until_a_session_ends(store, clock):
    accounts = Accounts(store)
    acct, other = accounts.account_id("two-runs"), accounts.account_id("other")
    accounts.set_quota("two-runs", max_concurrent_runs=2)
    accounts.set_quota("other", max_concurrent_runs=1)
    _live_run(store, "s1", acct, "s1:train:0")
    _live_run(store, "s2", acct, "s2:train:0")
    quotas = Quotas(store, ServerConfig())
    q = OpQueue()
    sched = Scheduler(q, quotas=quotas)
    q.put("third", "s2:train:1", 0, "CreateModel", create(acct, "s2:train:1"))
    q.put("fb-on-live", "s1:train:0", 1, "ForwardBackward", fb(acct, "s1:train:0", 3))  # a live run trains on
    q.put("other-create", "o:train:0", 0, "CreateModel", create(other, "o:train:0"))
    got = [sched.next(active_rows=0).ops[0].request_id for _ in range(2)]
    assert sorted(got) == ["fb-on-live", "other-create"]
    assert "2 of 2 concurrent training runs" in sched.pause_reason("third")
    store.update(SessionRow, "s1", finished_reason="success")  # ServiceClient.close() ...
    assert sched.pause_reason("third") is not None  # ... frees the place once the engine lets the run go:
    store.add(UnloadedRunRow(model_id="s1:train:0", unloaded_at=utcnow()))  # (residency releases it at once)
    assert sched.next(active_rows=0).ops[0].request_id == "third"
    q.put("fourth", "s2:train:2", 0, "CreateModel", create(acct, "s2:train:2"))
    _live_run(store, "s2", acct, "s2:train:1")  # "third" is done: two live runs again
    assert sched.pause_reason("fourth") is not None
    # A run of a session that stopped heart-beating, released from the engine, frees its slot too.
    store.add(UnloadedRunRow(model_id="s2:train:0", unloaded_at=utcnow()))
    assert sched.next(active_rows=0).ops[0].request_id == "fourth"


def test_a_released_run_coming_back_waits_for_a_place_like_a_creation(store, clock):
    accounts = Accounts(store)
    acct = accounts.account_id("one-run")
    accounts.set_quota("one-run", max_concurrent_runs=1)
    _live_run(store, "quiet", acct, "quiet:train:0")
    store.add(UnloadedRunRow(model_id="quiet:train:0", unloaded_at=utcnow()))  # its session went quiet
    _live_run(store, "busy", acct, "busy:train:0")  # the one place, taken meanwhile
    q = OpQueue()
    sched = Scheduler(q, quotas=Quotas(store, ServerConfig()))
    q.put("resume", "quiet:train:0", 3, "ForwardBackward", fb(acct, "quiet:train:0", 3))
    q.put("busy-fb", "busy:train:0", 1, "ForwardBackward", fb(acct, "busy:train:0", 3))
    assert sched.next(active_rows=0).ops[0].request_id == "busy-fb"  # a live run trains on
    assert "1 of 1 concurrent training runs" in sched.pause_reason("resume")
    store.add(UnloadedRunRow(model_id="busy:train:0", unloaded_at=utcnow()))  # the busy session ends
    assert sched.next(active_rows=0).ops[0].request_id == "resume"


def test_the_scheduler_sleeps_while_everything_is_paused_and_wakes_for_new_work(store, clock):
    accounts = Accounts(store)
    slow, fast = accounts.account_id("slow"), accounts.account_id("fast")
    accounts.set_quota("slow", max_tokens_per_minute=10)
    quotas = Quotas(store, ServerConfig())
    q = OpQueue()
    sched = Scheduler(q, quotas=quotas)
    q.put("slow-0", "m", 1, "ForwardBackward", fb(slow, "m", 50))
    q.put("slow-1", "m", 2, "ForwardBackward", fb(slow, "m", 50))
    assert sched.next(active_rows=0).ops[0].request_id == "slow-0"
    got, sleeping = [], threading.Event()
    wait_for_put = q.wait_for_put

    def spy(seen: int, timeout_s: float) -> None:
        sleeping.set()
        wait_for_put(seen, timeout_s)

    q.wait_for_put = spy
    worker = threading.Thread(target=lambda: got.append(sched.next(active_rows=0)))
    worker.start()  # only slow-1 is queued, and paused: next() must sleep, not hand out empty steps
    assert sleeping.wait(30) and not got
    q.put("fast-0", "f", 1, "ForwardBackward", fb(fast, "f", 5))
    worker.join(30)
    assert [o.request_id for o in got[0].ops] == ["fast-0"]
    q.close()


def test_an_accounts_table_from_before_quotas_gets_the_new_columns(tmp_path):
    import sqlite3

    db = tmp_path / "old.sqlite"
    with sqlite3.connect(db) as conn:  # the accounts table as tinkerd created it before quotas
        conn.execute("CREATE TABLE accounts (account_id VARCHAR PRIMARY KEY, name VARCHAR UNIQUE, created_at DATETIME)")
        conn.execute("INSERT INTO accounts VALUES ('acct-old', 'old', '2026-01-01 00:00:00')")
    accounts = Accounts(Store.sqlite(db))
    row = accounts.set_quota("old", max_concurrent_runs=3, max_tokens_per_minute=0)
    assert (row.max_concurrent_runs, row.max_tokens_per_minute) == (3, 0)
    assert Quotas(accounts.store, ServerConfig(max_tokens_per_minute=50)).limits("acct-old").max_tokens_per_minute is None
