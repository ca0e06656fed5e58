"""Retention of finished futures (control/retention.py): results expire after retrieval or at a max
age, tombstones are deleted later, and nothing recovery replays or quotas read is ever removed. No
engine: rows are written as control would write them, snapshots are empty seq- directories."""

from __future__ import annotations

import asyncio
from datetime import timedelta

import pytest
from sqlalchemy import func, select

from tinkerd.artifacts import LocalArtifactStore
from tinkerd.control.control import Control, Work
from tinkerd.control.recovery import Recovery
from tinkerd.control.retention import FutureRetention
from tinkerd.control.store.db import Store, utcnow
from tinkerd.control.store.tables import FutureRow, FutureWatermarkRow, SamplingSessionRow, TrainingRunRow, UsageRow
from tinkerd.errors import UserError
from tinkerd.types import AdamParams, OptimStepOp
from tests.unit.control.test_scheduler import FakeEngine

GRACE, MAX_AGE, TOMBSTONE = 600.0, 86400.0, 86400.0
MODEL = "sess-1:train:0"


def _row(seq: int | None, request_type: str, status: str = "complete", target: str = MODEL, age_s: float = 0.0,
         retrieved_age_s: float | None = None, account: str | None = "acct") -> FutureRow:
    now = utcnow()
    done = now - timedelta(seconds=age_s)
    return FutureRow(
        request_id=f"req-{target}-{request_type}-{seq}", request_type=request_type, target=target, seq_id=seq,
        dedupe_key=None if seq is None else f"{request_type}|{account}|{target}|{seq}", account_id=account,
        body=f"body-{seq}".encode(), status=status, result=b"{}" if status == "complete" else None,
        result_media_type="application/json", error="boom" if status == "failed" else None,
        error_category="user" if status == "failed" else None, created_at=done,
        completed_at=None if status == "pending" else done,
        retrieved_at=None if retrieved_age_s is None else now - timedelta(seconds=retrieved_age_s))


@pytest.fixture
def store(tmp_path):
    return Store.sqlite(tmp_path / "db.sqlite")


def _recovery(store, tmp_path) -> Recovery:
    # The plan's ops name the row they came from, so two plans compare op for op.
    return Recovery(store, LocalArtifactStore(tmp_path), rebuild=lambda row: Work((row.request_type, row.seq_id, row.body), None))


def _snapshot(recovery: Recovery, seq: int) -> None:
    recovery.artifacts.put(recovery.snapshot_key(MODEL, seq), {"adapter_model.safetensors": b"x"})


def _count(store) -> int:
    return store.query(select(func.count()).select_from(FutureRow))[0]


def test_a_retrieved_result_expires_after_the_grace_and_an_unretrieved_one_at_the_max_age(store, tmp_path):
    fresh = _row(None, "Sample", target="s1", age_s=GRACE * 2, retrieved_age_s=GRACE / 2)
    retrieved = _row(None, "Sample", target="s2", age_s=GRACE * 2, retrieved_age_s=GRACE * 1.5)
    unretrieved = _row(None, "Sample", target="s3", age_s=MAX_AGE / 2)
    old = _row(None, "Sample", target="s4", age_s=MAX_AGE * 1.5)
    failed = _row(None, "Sample", "failed", target="s5", age_s=GRACE * 2, retrieved_age_s=GRACE * 1.5)
    pending = _row(None, "Sample", "pending", target="s6", age_s=MAX_AGE * 2)
    for r in (fresh, retrieved, unretrieved, old, failed, pending):
        store.add(r)
    store.add(UsageRow(request_id=old.request_id, account_id="acct", target="s4", request_type="Sample",
                       completed_at=old.completed_at))
    retention = FutureRetention(store, _recovery(store, tmp_path), GRACE, MAX_AGE, TOMBSTONE)

    report = retention.sweep()

    assert report.expired == 3 and report.forgotten == 0
    for r in (retrieved, old, failed):
        row = store.get(FutureRow, r.request_id)
        assert row.expired_at is not None and row.result is None and row.error is None and row.body == b""
    for r in (fresh, unretrieved, pending):
        row = store.get(FutureRow, r.request_id)
        assert row.expired_at is None and row.body == r.body and row.result == r.result
    assert store.get(UsageRow, old.request_id) is not None  # billing is never swept
    # A tombstone is deleted tombstone_s after it expired; pending ops never are.
    assert retention.sweep(utcnow() + timedelta(seconds=TOMBSTONE * 1.1)).forgotten == 3
    assert {r.request_id for r in store.query(select(FutureRow))} == {fresh.request_id, unretrieved.request_id,
                                                                       pending.request_id}


def test_sweeping_never_changes_what_recovery_replays(store, tmp_path):
    recovery = _recovery(store, tmp_path)
    store.add(TrainingRunRow(model_id=MODEL, session_id="sess-1", base_model="m", lora_rank=8, lora_config={},
                             created_at=utcnow(), last_request_at=utcnow()))
    kinds = ["CreateModel"] + ["ForwardBackward", "OptimStep"] * 4 + ["ForwardBackward", "SaveWeights", "Forward"]
    for seq, kind in enumerate(kinds):
        store.add(_row(seq, kind, age_s=MAX_AGE * 2, retrieved_age_s=MAX_AGE * 2))
    store.add(_row(len(kinds), "ForwardBackward", "failed", age_s=MAX_AGE * 2, retrieved_age_s=MAX_AGE * 2))
    store.add(_row(len(kinds) + 1, "OptimStep", "pending", age_s=MAX_AGE * 2))
    _snapshot(recovery, 4)  # the engine keeps the two newest: after optim_steps 4 and 6
    _snapshot(recovery, 6)
    before = recovery.replay_plan()
    retention = FutureRetention(store, recovery, GRACE, MAX_AGE, TOMBSTONE)

    retention.sweep()
    assert retention.sweep(utcnow() + timedelta(seconds=TOMBSTONE * 2)).forgotten > 0

    assert recovery.replay_plan() == before
    assert before[0].dir_path.endswith("seq-000000000006") and [op[1] for op in before[1:]] == [7, 8, 9]
    left = {r.seq_id: r for r in store.query(select(FutureRow).where(FutureRow.target == MODEL))}
    # The creating op (quotas count the run by it), the snapshot's op and the state-changing ops
    # after it, and the pending one; older state-changing ops, saves, forwards, failures are gone.
    assert sorted(left) == [0, 6, 7, 8, 9, len(kinds) + 1]
    assert all(left[s].body == f"body-{s}".encode() for s in left)
    assert recovery.last_snapshot_point(MODEL) == 8
    assert recovery.pending()[0].seq_id == len(kinds) + 1
    # A later snapshot passes the kept ops: the next sweep forgets them.
    _snapshot(recovery, 8)
    retention.sweep(utcnow() + timedelta(seconds=TOMBSTONE * 2))
    assert sorted(r.seq_id for r in store.query(select(FutureRow).where(FutureRow.target == MODEL))) == \
        [0, 8, 9, len(kinds) + 1]


def test_a_run_without_a_snapshot_keeps_every_state_changing_op(store, tmp_path):
    recovery = _recovery(store, tmp_path)
    for seq, kind in enumerate(["CreateModel", "ForwardBackward", "ForwardBackward", "Forward"]):
        store.add(_row(seq, kind, age_s=MAX_AGE * 2, retrieved_age_s=MAX_AGE * 2))
    before = recovery.replay_plan()
    retention = FutureRetention(store, recovery, GRACE, MAX_AGE, TOMBSTONE)
    retention.sweep()
    retention.sweep(utcnow() + timedelta(seconds=TOMBSTONE * 2))
    assert recovery.replay_plan() == before and len(before) == 3
    assert _count(store) == 3


def test_a_resent_request_is_never_run_twice(store, tmp_path):
    control = Control(store, FakeEngine())
    work = lambda: Work(OptimStepOp(MODEL, AdamParams()), lambda r: (b"{}", "application/json"))  # noqa: E731
    recovery = _recovery(store, tmp_path)
    store.add(_row(1, "OptimStep", age_s=GRACE * 2, retrieved_age_s=GRACE * 2))
    store.add(_row(2, "OptimStep"))  # snapshotted: recovery no longer replays seq_id 1
    _snapshot(recovery, 2)
    original = store.get(FutureRow, f"req-{MODEL}-OptimStep-1")
    retention = FutureRetention(store, recovery, GRACE, MAX_AGE, TOMBSTONE)

    retention.sweep()  # expired: the tombstone still answers the re-send with the original future
    again = control.submit("OptimStep", MODEL, 1, b"resent", work(), account_id="acct")
    assert again.request_id == original.request_id and not again.new
    assert control.queue.depth(MODEL) == 0

    retention.sweep(utcnow() + timedelta(seconds=TOMBSTONE * 2))  # forgotten: refused, not run
    assert store.get(FutureRow, original.request_id) is None
    assert store.get(FutureWatermarkRow, f"OptimStep|acct|{MODEL}").seq_id == 1
    with pytest.raises(UserError, match="seq_id 1 .* has since expired; it is not run again"):
        control.submit("OptimStep", MODEL, 1, b"resent", work(), account_id="acct")
    assert control.queue.depth(MODEL) == 0
    # The next seq_id, and the same seq_id of another account's identity, are new work.
    assert control.submit("OptimStep", MODEL, 3, b"next", work(), account_id="acct").new
    assert control.submit("OptimStep", MODEL, 1, b"other", work(), account_id="other").new
    assert control.queue.depth(MODEL) == 2


def test_retrieving_starts_the_grace_once_and_an_expired_row_is_not_marked(store):
    control = Control(store, FakeEngine())
    store.add(_row(None, "Sample", target="s1"))
    store.add(_row(None, "Sample", "pending", target="s2"))
    rid, pending = "req-s1-Sample-None", "req-s2-Sample-None"
    first = asyncio.run(control.retrieve(rid, 0.0)).retrieved_at
    assert first is not None and store.get(FutureRow, rid).retrieved_at == first
    assert asyncio.run(control.retrieve(rid, 0.0)).retrieved_at == first  # a re-poll does not restart it
    assert asyncio.run(control.retrieve(pending, 0.01)).retrieved_at is None
    FutureRetention(store, None, GRACE, MAX_AGE, TOMBSTONE).sweep(first + timedelta(seconds=GRACE * 1.1))
    row = asyncio.run(control.retrieve(rid, 0.0))
    assert row.expired_at is not None and row.result is None


def test_a_retrieve_given_its_owner_checks_row_reads_no_more(store, monkeypatch):
    """retrieve_future reads the future once for its owner check and hands that row on; marking it
    retrieved is one UPDATE (that keeps the first mark), not a read and a write."""
    control = Control(store, FakeEngine())
    store.add(_row(None, "Sample", target="s1"))
    rid = "req-s1-Sample-None"
    owned = store.get(FutureRow, rid)
    reads = []
    get = store.get
    monkeypatch.setattr(store, "get", lambda *a: (reads.append(a), get(*a))[1])
    row = asyncio.run(control.retrieve(rid, 0.0, owned))
    assert reads == [] and row.retrieved_at is not None
    monkeypatch.setattr(store, "get", get)
    assert store.get(FutureRow, rid).retrieved_at == row.retrieved_at
    control.futures.mark_retrieved(rid, row.retrieved_at + timedelta(seconds=5))  # a late second mark
    assert store.get(FutureRow, rid).retrieved_at == row.retrieved_at


def test_watermarks_of_deleted_samplers_go_and_the_others_stay(store, tmp_path):
    """An RL loop makes a sampler per step and the session keeps its newest few: a watermark per
    sampler kept forever grew one row per step (benchmarks/soak.py)."""
    live, pruned = "sess-1:sample:7", "sess-1:sample:3"
    store.add(SamplingSessionRow(sampling_session_id=live, session_id="sess-1", base_model="tiny", model_path=None,
                                 adapter_dir=None, created_at=utcnow()))
    for target in (live, pruned):
        store.add(FutureWatermarkRow(dedupe_prefix=f"Sample|acct|{target}", seq_id=4))
    store.add(FutureWatermarkRow(dedupe_prefix=f"OptimStep|acct|{MODEL}", seq_id=9))
    retention = FutureRetention(store, _recovery(store, tmp_path), GRACE, MAX_AGE, TOMBSTONE)
    assert retention.sweep().marks_dropped == 1
    assert sorted(store.query(select(FutureWatermarkRow.dedupe_prefix))) == [
        f"OptimStep|acct|{MODEL}", f"Sample|acct|{live}"]
    assert retention.sweep().marks_dropped == 0
