"""AdminClient.get_audit_log (the caller's account's security events) and RestClient's sessions
endpoints (list, get, search, assign project), through the SDK; another account's sessions are 404."""

from __future__ import annotations

import subprocess
import sys
import warnings

import httpx
import pytest
import tinker
from tinker import types

from tests.conformance.conftest import TINY
from tests.conformance.test_ownership import _key


def _cli(data_dir, *args) -> str:
    return subprocess.run([sys.executable, "-m", "tinkerd.cli.main", *args[:1], "--data-dir", str(data_dir), *args[1:]],
                          capture_output=True, text=True, check=True).stdout


@pytest.fixture(scope="module")
def grace(server):
    key = _key(server.data_dir, "grace-audit")
    sc = tinker.ServiceClient(base_url=server.url, api_key=key, user_metadata={"team": "g"})
    tc = sc.create_lora_training_client(base_model=TINY, rank=4).result()
    return dict(key=key, sc=sc, tc=tc, session_id=tc.model_id.split(":")[0],
                rest=tinker.RestClient(base_url=server.url, api_key=key))


def test_audit_log_records_the_accounts_security_events(server, grace):
    rest = grace["rest"]
    path = grace["tc"].save_weights_for_sampler("audited").result().path
    rest.publish_checkpoint_from_tinker_path(path).result()
    rest.unpublish_checkpoint_from_tinker_path(path).result()
    copied = rest.copy_weights(path, "p").result()
    rest.delete_checkpoint_from_tinker_path(copied).result()
    _cli(server.data_dir, "accounts", "set-quota", "grace-audit", "--max-concurrent-runs", "5")
    out = _cli(server.data_dir, "keys", "create", "--name", "spare", "--account", "grace-audit")
    spare_id, spare = out.split()[1], out.split("TINKER_API_KEY=")[1].split()[0]
    _cli(server.data_dir, "keys", "revoke", spare_id)
    for _ in range(5):  # a flood with the revoked key: one row, with a count
        assert httpx.post(f"{server.url}/api/v1/create_session", json={}, headers={"X-API-Key": spare}).status_code == 401
    admin = tinker.AdminClient(base_url=server.url, api_key=grace["key"])
    log = admin.get_audit_log().result()
    assert isinstance(log, types.AuditLogResponse)
    events = [e.event for e in log.entries]
    for name in ("api_key_created", "checkpoint_published", "checkpoint_unpublished", "checkpoint_copied",
                 "checkpoint_deleted", "account_quota_set", "api_key_revoked", "auth_failed"):
        assert name in events, (name, events)
    assert [e.timestamp for e in log.entries] == sorted(e.timestamp for e in log.entries)
    failed = [e for e in log.entries if e.event == "auth_failed"]
    assert len(failed) == 1 and failed[0].event_details["count"] == 5 and failed[0].event_details["key_id"] == spare_id
    published = next(e for e in log.entries if e.event == "checkpoint_published")
    assert published.tinker_path == path and published.model_id == grace["tc"].model_id
    assert spare not in log.model_dump_json() and grace["key"] not in log.model_dump_json()
    only = admin.get_audit_log(event_type="checkpoints").result().entries
    assert only and all(e.event.startswith("checkpoint_") for e in only)
    # Another account sees none of it.
    other = tinker.AdminClient(base_url=server.url, api_key=_key(server.data_dir, "heidi-audit")).get_audit_log().result()
    assert not {e.tinker_path for e in other.entries} & {path, copied}
    assert "auth_failed" not in [e.event for e in other.entries]


def test_sessions_list_get_search(server, grace):
    rest = grace["rest"]
    sid = grace["session_id"]
    assert sid in rest.list_sessions(limit=100).result().sessions
    got = rest.get_session(sid).result()
    assert got.training_run_ids == [grace["tc"].model_id] and got.user_metadata == {"team": "g"}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        found = rest.search_sessions(types.SessionSearchRequest(user_metadata={"team": "g"})).result()
        assert [s.session_id for s in found.sessions] == [sid] and found.sessions[0].owner
        assert found.sessions[0].status.type == "active"
        page = rest.search_sessions(types.SessionSearchRequest(limit=1)).result()
        assert len(page.sessions) == 1 and page.next_cursor is not None
        nxt = rest.search_sessions(types.SessionSearchRequest(limit=1, cursor=page.next_cursor)).result()
        assert nxt.sessions and nxt.sessions[0].session_id != page.sessions[0].session_id
    with pytest.raises(tinker.BadRequestError):  # a session cannot leave its project; real ones: test_projects.py
        rest.assign_session_project(sid, "").result()


def test_other_accounts_sessions_are_missing(server, grace):
    b = tinker.RestClient(base_url=server.url, api_key=_key(server.data_dir, "ivan-sessions"))
    assert grace["session_id"] not in b.list_sessions(limit=1000).result().sessions
    for sid in (grace["session_id"], "sess-0000000000000000"):
        with pytest.raises(tinker.NotFoundError):
            b.get_session(sid).result()
        with pytest.raises(tinker.NotFoundError):
            b.assign_session_project(sid, "proj").result()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert not b.search_sessions(types.SessionSearchRequest(session_id=grace["session_id"])).result().sessions
