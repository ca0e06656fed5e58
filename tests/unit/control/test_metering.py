"""Metering and ownership in the control plane: usage rows, hourly buckets, owned_* lookups."""

from __future__ import annotations

from datetime import datetime

import pytest

from tinkerd.artifacts import LocalArtifactStore
from tinkerd.control.metering import Billing, Meter, Usage, hourly_buckets, totals
from tinkerd.control.ids import TinkerPath
from tinkerd.control.runs import Runs
from tinkerd.control.store.db import Store
from tinkerd.control.store.tables import UsageRow
from tinkerd.errors import NotFoundError


def test_record_once_per_request_and_bucket_by_hour(tmp_path):
    meter = Meter(Store.sqlite(tmp_path / "db.sqlite"))
    billing = Billing("acct-a", "sess-1", "tiny", lambda n: Usage(trained_tokens=n))
    meter.record("req-1", "ForwardBackward", "m", billing, 12, queue_wait_s=5.0, compute_s=0.5)
    meter.record("req-1", "ForwardBackward", "m", billing, 12, queue_wait_s=9.0, compute_s=0.5)  # re-run: kept once
    meter.record("req-2", "ForwardBackward", "m", billing, 3, queue_wait_s=-1.0, compute_s=0.1)
    rows = meter.rows("acct-a")
    assert [r.trained_tokens for r in rows] == [12, 3] and rows[1].queue_wait_s == 0.0
    assert meter.rows("acct-b") == []
    [bucket] = hourly_buckets(rows)
    assert (bucket.kind, bucket.quantity, bucket.session_id) == ("trained_tokens", 15, "sess-1")
    t = totals(rows)["acct-a"]
    assert t["trained_tokens"] == 15 and t["queue_wait_s"] == 5.0 and t["ops"] == 2


def test_buckets_split_by_hour_and_kind():
    def row(hour, **q):
        return UsageRow(request_id=f"r{hour}{q}", account_id="a", session_id="s", target="t", base_model="m",
                        request_type="Sample", completed_at=datetime(2026, 1, 1, hour, 30),
                        **{k: q.get(k, 0) for k in ("prefill_tokens", "sampled_tokens", "trained_tokens",
                                                    "forward_tokens", "checkpoints")})

    buckets = hourly_buckets([row(1, prefill_tokens=6, sampled_tokens=8), row(2, prefill_tokens=1)])
    assert [(b.start.hour, b.kind, b.quantity) for b in buckets] == [
        (1, "sampled_tokens", 8), (1, "prefill_tokens", 6), (2, "prefill_tokens", 1)]


def test_owned_lookups_answer_like_missing_ids(tmp_path):
    runs = Runs(Store.sqlite(tmp_path / "db.sqlite"), LocalArtifactStore(tmp_path))
    sess = runs.sessions.create_session([], {}, "test", account_id="acct-a")
    run, _ = runs.training_runs.create_run(sess, 0, "tiny", {"rank": 4}, {}, account_id="acct-a")
    assert runs.training_runs.owned_run(run.model_id, "acct-a").model_id == run.model_id
    assert runs.training_runs.owned_run(run.model_id, None).model_id == run.model_id  # internal callers
    with pytest.raises(NotFoundError, match="unknown model_id"):
        runs.training_runs.owned_run(run.model_id, "acct-b")
    with pytest.raises(NotFoundError, match="unknown session_id"):
        runs.training_runs.create_run(sess, 1, "tiny", {"rank": 4}, {}, account_id="acct-b")
    path = TinkerPath(run.model_id, "weights", "w")
    runs.artifacts.path(runs.checkpoints.checkpoint_key(path)).mkdir(parents=True)
    runs.checkpoints.register_checkpoint(path, None, None)
    assert runs.checkpoints.owned_checkpoint(path, "acct-a")
    with pytest.raises(NotFoundError, match="does not exist"):
        runs.checkpoints.owned_checkpoint(path, "acct-b")
    runs.checkpoints.set_public(path, True, "acct-a")
    assert runs.checkpoints.owned_checkpoint(path, "acct-b", public_ok=True)  # published: loadable by path
    with pytest.raises(NotFoundError):
        runs.checkpoints.delete_checkpoint(path, "acct-b")
    assert runs.checkpoints.list_checkpoints(account_id="acct-b") == ([], 0)
    assert runs.training_runs.list_runs(account_id="acct-b") == ([], 0) and runs.training_runs.list_runs(account_id="acct-a")[1] == 1
