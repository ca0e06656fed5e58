"""Projects through the unmodified tinker 0.38.0 SDK: a session's project (ServiceClient(project_id),
RestClient.assign_session_project, copy_weights' destination) groups its runs and checkpoints, and
the project filters of list_training_runs, search_sessions and checkpoint storage see only it.
Projects are per account: another account's project answers 404, as any unknown id does."""

from __future__ import annotations

import warnings

import httpx
import pytest
import tinker
from tinker import types

from tests.conformance.conftest import TINY
from tests.conformance.test_ownership import _key


def _runs(rest, project_id=None) -> set[str]:
    return {r.training_run_id for r in rest.list_training_runs(limit=1000, project_id=project_id).result().training_runs}


def _search(rest, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return rest.search_sessions(types.SessionSearchRequest(limit=100, **kw)).result().sessions


@pytest.fixture(scope="module")
def world(server):
    key = _key(server.data_dir, "pia-projects")
    in_alpha = tinker.ServiceClient(base_url=server.url, api_key=key, project_id="alpha")
    loose = tinker.ServiceClient(base_url=server.url, api_key=key)
    tc_alpha = in_alpha.create_lora_training_client(base_model=TINY, rank=4).result()
    tc_loose = loose.create_lora_training_client(base_model=TINY, rank=4).result()
    ckpt = tc_alpha.save_state("p-ckpt").result().path
    return dict(key=key, url=server.url, rest=tinker.RestClient(base_url=server.url, api_key=key), ckpt=ckpt,
                alpha=tc_alpha.model_id, loose=tc_loose.model_id,
                alpha_session=in_alpha.holder.get_session_id(), loose_session=loose.holder.get_session_id())


def test_a_session_created_in_a_project_groups_its_runs(world):
    rest = world["rest"]
    assert _runs(rest, "alpha") == {world["alpha"]} and {world["alpha"], world["loose"]} <= _runs(rest)
    found = _search(rest, project_ids=["alpha"])
    assert [s.session_id for s in found] == [world["alpha_session"]] and found[0].project_id == "alpha"
    assert {s.session_id: s.project_id for s in _search(rest)}[world["loose_session"]] == ""


def test_assign_moves_a_session_and_is_audited(world):
    rest = world["rest"]
    rest.assign_session_project(world["loose_session"], "beta").result()
    assert _runs(rest, "beta") == {world["loose"]}
    both = {s.session_id: s.project_id for s in _search(rest, project_ids=["beta", "alpha"])}
    assert both == {world["loose_session"]: "beta", world["alpha_session"]: "alpha"}
    events = tinker.AdminClient(base_url=world["url"], api_key=world["key"]).get_audit_log("projects").result()
    moved = [e for e in events.entries if e.event == "project_session_assigned"]
    assert moved and moved[-1].event_details["project_id"] == "beta"
    assert moved[-1].event_details["session_id"] == world["loose_session"]


def test_a_copy_into_a_project_and_storage_by_project(world):
    rest = world["rest"]
    copied = rest.copy_weights(world["ckpt"], "gamma").result()
    gamma = _runs(rest, "gamma")
    assert len(gamma) == 1 and copied.startswith(f"tinker://{next(iter(gamma))}/")
    admin = tinker.AdminClient(base_url=world["url"], api_key=world["key"])
    usage = admin.get_current_checkpoint_storage_usage(project_id="gamma").result()
    assert [(d.project_id, d.checkpoint_count) for d in usage.data] == [("gamma", 1)]
    everything = {d.project_id: d.checkpoint_count for d in admin.get_current_checkpoint_storage_usage().result().data}
    assert everything["gamma"] == 1 and everything["alpha"] == 1


def test_projects_are_per_account(server, world):
    other_key = _key(server.data_dir, "quinn-projects")
    other = tinker.RestClient(base_url=server.url, api_key=other_key)
    with pytest.raises(tinker.NotFoundError):
        other.list_training_runs(project_id="alpha").result()
    with pytest.raises(tinker.NotFoundError):
        tinker.AdminClient(base_url=server.url, api_key=other_key).get_current_checkpoint_storage_usage(
            project_id="alpha").result()
    with pytest.raises(tinker.NotFoundError):
        _search(other, project_ids=["alpha"])
    # Its own "alpha" is another project: each account sees only its own runs in it.
    mine = tinker.ServiceClient(base_url=server.url, api_key=other_key, project_id="alpha")
    tc = mine.create_lora_training_client(base_model=TINY, rank=4).result()
    assert _runs(other, "alpha") == {tc.model_id} and _runs(world["rest"], "alpha") == {world["alpha"]}
    with pytest.raises(tinker.NotFoundError):  # moving a foreign session is a 404 before anything else
        other.assign_session_project(world["alpha_session"], "alpha").result()


def test_bad_project_ids_are_user_400s(world):
    api, headers = f"{world['url']}/api/v1", {"X-API-Key": world["key"]}
    checks = [
        httpx.get(f"{api}/training_runs", params={"project_id": "../x"}, headers=headers),
        httpx.get(f"{api}/billing/usage/checkpoints/current", params={"project_id": "a" * 200}, headers=headers),
        httpx.put(f"{api}/sessions/{world['alpha_session']}/project", json={}, headers=headers),
        httpx.put(f"{api}/sessions/{world['alpha_session']}/project", json={"project_id": 7}, headers=headers),
        httpx.post(f"{api}/sessions/search", json={"project_ids": ["a/b"]}, headers=headers),
        httpx.post(f"{api}/create_session", json={"tags": [], "sdk_version": "0.38.0", "project_id": "a b",
                                                  "type": "create_session"}, headers=headers),
    ]
    for r in checks:
        assert r.status_code == 400 and r.json()["category"] == "user", (r.request.url, r.text)
