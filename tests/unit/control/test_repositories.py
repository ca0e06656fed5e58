"""The repositories hand out domain objects, not SQLAlchemy's (issue 18), for the nouns converted so
far: accounts, API keys, audit entries, usage records, sessions, sampling sessions, training runs and
checkpoints are frozen dataclasses with the stored values, on both backends. A caller cannot change
one and believe it stored, nor hold a session open through it."""

from __future__ import annotations

import dataclasses
from datetime import timedelta

import pytest

from tinkerd.control.accounts import Accounts, hash_key
from tinkerd.artifacts import LocalArtifactStore
from tinkerd.control.metering import Billing, Meter, Usage
from tinkerd.control.ids import parse_tinker_path
from tinkerd.control.runs import Runs
from tinkerd.control.sessions import SessionSearch
from tinkerd.control.store.db import Store, utcnow
from tinkerd.control.store.tables import Base
from tinkerd.errors import NotFoundError


def _frozen(obj) -> None:
    assert dataclasses.is_dataclass(obj) and not isinstance(obj, Base), type(obj)
    field = dataclasses.fields(obj)[0].name
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(obj, field, "changed")


def test_accounts_keys_and_audit_entries_are_frozen_dataclasses(db_url):
    accounts = Accounts(Store(db_url))
    new = accounts.create_key("ci", account="team-a", key="tml-" + "k" * 40)
    accounts.set_quota("team-a", max_concurrent_runs=3)

    [account] = accounts.list_accounts()
    _frozen(account)
    assert (account.name, account.max_concurrent_runs, account.max_tokens_per_minute) == ("team-a", 3, None)
    assert accounts.set_quota("team-a", max_tokens_per_minute=0) == dataclasses.replace(account, max_tokens_per_minute=0)

    key = accounts.key_row("tml-" + "k" * 40)
    _frozen(key)
    assert (key.key_id, key.key_hash, key.account_id, key.name, key.revoked_at) == (
        new.key_id, hash_key("tml-" + "k" * 40), account.account_id, "ci", None)
    assert accounts.key_by_id(new.key_id) == key and accounts.list_keys() == [(key, "team-a")]
    accounts.revoke(new.key_id)
    assert accounts.key_by_id(new.key_id).revoked_at is not None and key.revoked_at is None  # a copy, not a view

    accounts.auth_failed("tml-" + "k" * 40, "1.2.3.4")  # a revoked key: audited under its account
    entries = accounts.audit.entries(account.account_id, utcnow() - timedelta(minutes=5), utcnow() + timedelta(minutes=1))
    for entry in entries:
        _frozen(entry)
    assert [e.event for e in entries] == ["api_key_created", "account_quota_set", "account_quota_set",
                                          "api_key_revoked", "auth_failed"]
    assert entries[-1].details == {"source": "1.2.3.4", "reason": "revoked key", "key_id": new.key_id}


def test_usage_records_are_frozen_dataclasses(db_url):
    meter = Meter(Store(db_url))
    billing = Billing("acct-a", "sess-1", "tiny", lambda result: Usage(trained_tokens=result, checkpoints=1))
    meter.record("req-1", "ForwardBackward", "sess-1:train:0", billing, 7, queue_wait_s=0.5, compute_s=2.0)
    meter.record("req-1", "ForwardBackward", "sess-1:train:0", billing, 9, queue_wait_s=0.5, compute_s=2.0)  # redone
    [record] = meter.rows("acct-a")
    _frozen(record)
    assert (record.request_id, record.account_id, record.session_id, record.target, record.base_model,
            record.trained_tokens, record.checkpoints, record.queue_wait_s, record.compute_s) == (
        "req-1", "acct-a", "sess-1", "sess-1:train:0", "tiny", 7, 1, 0.5, 2.0)  # the first record stays
    assert meter.rows("acct-b") == [] and meter.usage.of_accounts_after(record.completed_at - timedelta(seconds=1)) == [record]


def test_sessions_are_frozen_dataclasses(db_url, tmp_path):
    runs = Runs(Store(db_url), LocalArtifactStore(tmp_path))
    sid = runs.sessions.create_session(["a"], {"k": "v"}, "0.38", account_id="acct-a", display_name="first", project_id="p")
    session = runs.sessions.owned_session(sid, "acct-a")
    _frozen(session)
    assert (session.session_id, session.account_id, session.tags, session.user_metadata, session.sdk_version,
            session.finished_reason, session.display_name, session.project_id) == (
        sid, "acct-a", ["a"], {"k": "v"}, "0.38", None, "first", "p")
    runs.sessions.finish_session(sid, "success", "acct-a")
    assert runs.sessions.session(sid).finished_reason == "success" and session.finished_reason is None  # a copy
    sessions = runs.sessions
    [found], more = sessions.search("acct-a", SessionSearch(display_name="first"))
    assert found == runs.sessions.session(sid) and not more and sessions.by_ids({sid}) == [found]
    with pytest.raises(NotFoundError):
        runs.sessions.owned_session(sid, "acct-b")  # another account's session is missing, as before


def test_sampling_sessions_are_frozen_dataclasses(db_url, tmp_path):
    runs = Runs(Store(db_url), LocalArtifactStore(tmp_path))
    sid = runs.sessions.create_session([], {}, "0.38", account_id="acct-a")
    sampler = runs.sampling_sessions.create_sampling_session(sid, 0, "tiny", "tinker://r/sampler_weights/x", "checkpoints/r/x", "acct-a")
    _frozen(sampler)
    assert runs.sampling_sessions.create_sampling_session(sid, 0, "tiny", None, None, "acct-a") == sampler  # a re-send: the same one
    assert runs.sampling_sessions.owned_sampling_session(sampler.sampling_session_id, "acct-a") == sampler
    assert (sampler.sampling_session_id, sampler.session_id, sampler.model_path, sampler.adapter_dir,
            sampler.clients_joined, sampler.inflight_of) == (f"{sid}:sample:0", sid, "tinker://r/sampler_weights/x",
                                                            "checkpoints/r/x", None, None)
    assert runs.sampling_sessions.join_sampling_session(sampler.sampling_session_id, "acct-a") == 1
    assert runs.sampling_sessions.sampling_session(sampler.sampling_session_id).clients_joined == 1 and sampler.clients_joined is None
    with pytest.raises(NotFoundError):
        runs.sampling_sessions.owned_sampling_session(sampler.sampling_session_id, "acct-b")


def test_training_runs_are_frozen_dataclasses(db_url, tmp_path):
    runs = Runs(Store(db_url), LocalArtifactStore(tmp_path))
    sid = runs.sessions.create_session([], {}, "0.38", account_id="acct-a")
    run, created = runs.training_runs.create_run(sid, 0, "tiny", {"rank": 4}, {"k": 1}, "acct-a")
    _frozen(run)
    assert created and (run.model_id, run.session_id, run.base_model, run.lora_rank, run.lora_config, run.user_metadata) == (
        f"{sid}:train:0", sid, "tiny", 4, {"rank": 4}, {"k": "1"})
    again, created = runs.training_runs.create_run(sid, 0, "tiny", {"rank": 8}, None, "acct-a")
    assert not created and again == run  # a re-send: the stored one
    assert runs.training_runs.owned_run(run.model_id, "acct-a") == run
    [listed], total = runs.training_runs.list_runs(account_id="acct-a")
    _frozen(listed)
    assert listed == run and total == 1
    runs.training_runs.touch(run.model_id)
    assert runs.training_runs.run(run.model_id).last_request_at > run.last_request_at  # a copy, not a view
    with pytest.raises(NotFoundError):
        runs.training_runs.owned_run(run.model_id, "acct-b")


def test_checkpoints_are_frozen_dataclasses(db_url, tmp_path):
    runs = Runs(Store(db_url), LocalArtifactStore(tmp_path))
    sid = runs.sessions.create_session([], {}, "0.38", account_id="acct-a")
    run, _ = runs.training_runs.create_run(sid, 0, "tiny", {"rank": 4}, None, "acct-a")
    path = parse_tinker_path(f"tinker://{run.model_id}/weights/step-1")
    runs.artifacts.put(runs.checkpoints.checkpoint_key(path), {"adapter_model.safetensors": b"x" * 10})
    ckpt = runs.checkpoints.register_checkpoint(path, 3600, {"step": 1})
    _frozen(ckpt)
    assert (ckpt.tinker_path, ckpt.model_id, ckpt.checkpoint_type, ckpt.name, ckpt.size_bytes, ckpt.public,
            ckpt.user_metadata) == (str(path), run.model_id, "training", "step-1", 10, False, {"step": "1"})
    assert runs.checkpoints.owned_checkpoint(path, "acct-a") == ckpt
    [listed], total = runs.checkpoints.list_checkpoints(account_id="acct-a")
    assert listed == ckpt and total == 1 and runs.checkpoints.last_checkpoint(run.model_id, "training") == ckpt
    _frozen(listed)
    runs.checkpoints.set_public(path, True, "acct-a")
    assert runs.checkpoints.checkpoint(path).public and not ckpt.public  # a copy, not a view
    assert runs.checkpoints.set_ttl(path, None, "acct-a").expires_at is None and ckpt.expires_at is not None
    with pytest.raises(NotFoundError):
        runs.checkpoints.owned_checkpoint(path, "acct-b")
    runs.checkpoints.delete_checkpoint(path, "acct-a")
    assert not runs.checkpoints.checkpoint_exists(path)
