"""The console's queries (control/overview.py, control/stepmetrics.py, control/costs.py) on a real SQLite
store: runs paged in the database for one account, step metrics stored once per op, per-run usage."""

from __future__ import annotations

from datetime import datetime, timedelta

import numpy as np
import pytest
from sqlalchemy import event, insert

from tinkerd.control import costs, overview
from tinkerd.control.metering import Meter
from tinkerd.control.storage import StorageLedger
from tinkerd.control.stepmetrics import StepMetrics, series
from tinkerd.control.store.db import Store
from tinkerd.control.store.tables import (FutureRow, SamplingSessionRow, SessionRow, TrainingRunRow, UnloadedRunRow,
                                          UsageRow)
from tinkerd.types import AdamParams, ForwardBackwardOp, ForwardBackwardResult, OptimStepOp, SampleOp

T0 = datetime(2026, 3, 1, 12, 0)
RUNS = 3000


@pytest.fixture
def store(tmp_path):
    return Store.sqlite(tmp_path / "db.sqlite")


def _many_runs(store: Store) -> None:
    """RUNS runs for account a (one session each) and as many for b, in bulk."""
    sessions, runs = [], []
    for acct in ("a", "b"):
        for i in range(RUNS):
            sid = f"sess-{acct}{i:05d}"
            sessions.append(dict(session_id=sid, account_id=acct, created_at=T0, last_heartbeat_at=T0, tags=[],
                                 user_metadata={}, finished_reason="done" if i % 3 == 0 else None))
            runs.append(dict(model_id=f"{sid}:train:0", session_id=sid, base_model="tiny", lora_rank=4,
                             lora_config={"rank": 4}, user_metadata={}, created_at=T0 + timedelta(seconds=i),
                             last_request_at=T0 + timedelta(seconds=i)))
    with store.write() as s:
        s.execute(insert(SessionRow), sessions)
        s.execute(insert(TrainingRunRow), runs)
        s.add(UnloadedRunRow(model_id=f"sess-a{RUNS - 2:05d}:train:0", unloaded_at=T0))


def test_runs_page_in_the_database_for_one_account(store):
    _many_runs(store)
    statements = []
    event.listen(store.engine, "before_cursor_execute", lambda *a: statements.append(a[2]))
    rows, total = overview.run_page(store, "a", limit=50, offset=50)
    assert total == RUNS and len(rows) == 50
    # Newest first: the second page starts 50 below the newest.
    assert [r.model_id for r in rows] == [f"sess-a{i:05d}:train:0" for i in range(RUNS - 51, RUNS - 101, -1)]
    assert {r.status for r in rows} == {"finished", "active"}
    page_sql = [s for s in statements if "training_runs" in s and "count(" not in s.lower()]
    assert len(page_sql) == 1 and "LIMIT" in page_sql[0] and "OFFSET" in page_sql[0]  # paged by the database
    first, _ = overview.run_page(store, "a", limit=3, offset=0)
    assert [r.status for r in first] == ["active", "released", "finished"]  # RUNS-1, RUNS-2 (unloaded), RUNS-3
    assert overview.run_page(store, "nobody", limit=50, offset=0) == ([], 0)


def _future(store: Store, request_id: str, request_type: str, seq_id: int) -> None:
    store.add(FutureRow(request_id=request_id, request_type=request_type, target="m", seq_id=seq_id, body=b"",
                        status="pending", created_at=T0))


def test_step_metrics_one_row_per_op_in_seq_order(store):
    metrics = StepMetrics(store)
    fb = ForwardBackwardOp("m", [], "cross_entropy")
    for seq, loss in ((3, 2.5), (1, 4.0)):
        _future(store, f"r{seq}", "ForwardBackward", seq)
        metrics.record(f"r{seq}", fb, ForwardBackwardResult([], {"loss:sum": loss, "bad:mean": float("nan")}))
    metrics.record("r3", fb, ForwardBackwardResult([], {"loss:sum": 99.0}))  # a redo keeps the first
    _future(store, "r4", "Forward", 4)
    metrics.record("r4", ForwardBackwardOp("m", [], "cross_entropy", forward_only=True),
                   ForwardBackwardResult([], {"loss:sum": 3.0}))
    _future(store, "r5", "OptimStep", 5)
    metrics.record("r5", OptimStepOp("m", AdamParams()), {})  # no metrics: nothing to draw, no row
    metrics.record("internal", fb, ForwardBackwardResult([], {"loss:sum": 1.0}))  # no future: not the user's
    points = metrics.points("m")
    assert [(p.seq_id, p.request_type) for p in points] == [(1, "ForwardBackward"), (3, "ForwardBackward"), (4, "Forward")]
    assert series(points) == {"loss:sum": [(1, 4.0), (3, 2.5)], "eval loss:sum": [(4, 3.0)]}
    assert [p.seq_id for p in metrics.points("m", after_seq=1)] == [3, 4]
    assert [p.seq_id for p in metrics.points("m", limit=1)] == [4]  # the newest
    assert metrics.points("other") == []


def test_a_step_metric_reads_two_columns_of_its_future_not_its_body(store, monkeypatch):
    metrics = StepMetrics(store)
    _future(store, "r1", "ForwardBackward", 1)
    monkeypatch.setattr(store, "get", lambda *a: pytest.fail(f"a whole row was loaded: {a}"))
    metrics.record("r1", ForwardBackwardOp("m", [], "cross_entropy"), ForwardBackwardResult([], {"loss:sum": 1.5}))
    assert [(p.seq_id, p.request_type, p.metrics) for p in metrics.points("m")] == [(1, "ForwardBackward", {"loss:sum": 1.5})]


def test_run_usage_follows_samplers_to_their_run(store):
    store.add(SessionRow(session_id="s", account_id="a", created_at=T0, last_heartbeat_at=T0))
    store.add(TrainingRunRow(model_id="s:train:0", session_id="s", base_model="tiny", lora_rank=4,
                             lora_config={"rank": 4}, created_at=T0, last_request_at=T0))
    store.add(SamplingSessionRow(sampling_session_id="s:sample:0", session_id="s", base_model="tiny",
                                 model_path="tinker://s:train:0/sampler_weights/x", created_at=T0))
    store.add(SamplingSessionRow(sampling_session_id="s:sample:1", session_id="s", base_model="tiny", created_at=T0))
    rows = [("f1", "s:train:0", dict(trained_tokens=10)), ("f2", "s:sample:0", dict(prefill_tokens=3, sampled_tokens=7)),
            ("f3", "s:sample:1", dict(prefill_tokens=5)), ("f4", "s:train:0", dict(trained_tokens=1))]
    for rid, target, n in rows:
        store.add(UsageRow(request_id=rid, account_id="a", target=target, request_type="x", completed_at=T0, **n))
    store.add(UsageRow(request_id="other", account_id="b", target="s:train:0", request_type="x", completed_at=T0,
                       trained_tokens=1000))
    by_run = costs.run_usage(store, StorageLedger(store), "a", T0 - timedelta(hours=1), T0 + timedelta(hours=1), T0)
    assert by_run["s:train:0"].quantities == {"trained_tokens": 11, "forward_tokens": 0, "prefill_tokens": 3,
                                                  "sampled_tokens": 7, "storage_gb_hours": 0}
    assert by_run[None].quantities["prefill_tokens"] == 5  # a base-model sampler belongs to no run
    total = costs.account_usage(store, Meter(store), StorageLedger(store), "a", T0 - timedelta(hours=1),
                                T0 + timedelta(hours=1), T0)
    assert total.quantities["trained_tokens"] == 11 and total.quantities["prefill_tokens"] == 8
    activity = overview.sampling_activity(store, "s:train:0")
    assert [(a.sampling_session_id, a.requests, a.prefill_tokens, a.sampled_tokens) for a in activity] == [
        ("s:sample:0", 1, 3, 7)]
