"""RestClient.copy_weights: a real copy (row + files) the caller owns, loadable and listed; refusals
are user errors, and another account's unpublished checkpoint answers like a missing one."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import tinker
from tinker import types

from tests.conformance.conftest import TINY
from tests.conformance.test_ownership import _datum, _key
from tests.serverproc import API_KEY


@pytest.fixture(scope="module")
def made(server):
    a = tinker.ServiceClient(base_url=server.url, api_key=API_KEY)
    tc = a.create_lora_training_client(base_model=TINY, rank=4).result()
    tc.forward_backward([_datum()], "cross_entropy").result()
    tc.optim_step(types.AdamParams(learning_rate=1e-3)).result()
    return dict(a=a, tc=tc, state=tc.save_state("copy-src").result().path,
                sampler=tc.save_weights_for_sampler("copy-src-s").result().path)


def test_copy_is_a_loadable_listed_checkpoint(server, made):
    rest = made["a"].create_rest_client()
    copied = rest.copy_weights(made["state"], "any-project").result()
    assert copied != made["state"] and copied.endswith("/weights/copy-src")
    listed = {c.tinker_path: c for c in rest.list_user_checkpoints(limit=1000).result().checkpoints}
    assert copied in listed and listed[copied].size_bytes == listed[made["state"]].size_bytes
    run_id = copied.split("://")[1].split("/")[0]
    assert rest.get_training_run(run_id).result().base_model == TINY
    files = Path(server.data_dir) / "checkpoints" / run_id / "weights" / "copy-src"
    assert files.is_dir() and not list(files.parent.glob(".*tmp-*"))
    tc2 = made["a"].create_training_client_from_state(copied).result()
    assert tc2.forward_backward([_datum()], "cross_entropy").result()
    sampler_copy = rest.copy_weights(made["sampler"], "any-project", ttl_seconds=7200).result()
    sc = made["a"].create_sampling_client(model_path=sampler_copy)
    assert sc.sample(types.ModelInput.from_ints([1, 2]), 1, types.SamplingParams(max_tokens=2)).result().sequences
    # The source is untouched; deleting the copy leaves it loadable.
    rest.delete_checkpoint_from_tinker_path(copied).result()
    assert made["a"].create_training_client_from_state(made["state"]).result()
    # A copy's run holds copies only: training ops on it are user errors, not engine failures.
    r = httpx.post(f"{server.url}/api/v1/optim_step", headers={"X-API-Key": API_KEY},
                   json={"model_id": run_id, "seq_id": 1, "adam_params": {"learning_rate": 1e-3}})
    assert r.status_code == 400 and "cannot be trained on" in r.json()["error"]


def test_retry_with_the_same_idempotency_key_makes_one_copy(server, made):
    body = {"source_path": made["state"], "destination_project_id": "p"}
    h = {"X-API-Key": API_KEY, "X-Idempotency-Key": "copy-retry-1"}
    first = httpx.post(f"{server.url}/api/v1/copy_weights", json=body, headers=h).json()["tinker_path"]
    assert httpx.post(f"{server.url}/api/v1/copy_weights", json=body, headers=h).json()["tinker_path"] == first


def test_copy_into_a_session_slot_and_existing_destination(server, made):
    session_id = made["tc"].model_id.split(":")[0]
    h = {"X-API-Key": API_KEY}
    body = {"source_path": made["state"], "session_id": session_id, "model_seq_id": 77}
    r = httpx.post(f"{server.url}/api/v1/copy_weights", json=body, headers=h)
    assert r.status_code == 200 and r.json()["tinker_path"] == f"tinker://{session_id}:train:77/weights/copy-src"
    r = httpx.post(f"{server.url}/api/v1/copy_weights", json=body, headers=h)
    assert r.status_code == 400 and r.json()["category"] == "user" and "already exists" in r.json()["error"]


@pytest.mark.parametrize("body", [
    {"source_path": "tinker://nope/weights/../x", "destination_project_id": "p"},
    {"source_path": "not-a-path", "destination_project_id": "p"},
    {"source_path": "tinker://x:train:0/weights/a"},
])
def test_bad_requests_are_user_errors(server, body):
    r = httpx.post(f"{server.url}/api/v1/copy_weights", json=body, headers={"X-API-Key": API_KEY})
    assert r.status_code == 400 and r.json()["category"] == "user"


def test_foreign_is_missing_unless_published(server, made):
    b = tinker.ServiceClient(base_url=server.url, api_key=_key(server.data_dir, "bob-copy")).create_rest_client()
    with pytest.raises(tinker.NotFoundError) as foreign:
        b.copy_weights(made["state"], "p").result()
    missing = made["state"].rsplit("/", 1)[0] + "/never-saved"
    with pytest.raises(tinker.NotFoundError) as absent:
        b.copy_weights(missing, "p").result()
    assert str(foreign.value).replace(made["state"], "X") == str(absent.value).replace(missing, "X")
    rest = made["a"].create_rest_client()
    rest.publish_checkpoint_from_tinker_path(made["sampler"]).result()
    try:
        copied = b.copy_weights(made["sampler"], "p").result()
        assert copied in {c.tinker_path for c in b.list_user_checkpoints(limit=1000).result().checkpoints}
        assert copied not in {c.tinker_path for c in rest.list_user_checkpoints(limit=1000).result().checkpoints}
    finally:
        rest.unpublish_checkpoint_from_tinker_path(made["sampler"]).result()
