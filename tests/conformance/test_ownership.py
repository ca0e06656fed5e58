"""Ownership: everything account A makes is invisible and untouchable to account B, through the SDK and
plain HTTP, and answers B exactly like an id that does not exist (404, user category)."""

from __future__ import annotations

import subprocess
import sys

import httpx
import numpy as np
import pytest
import tinker
from tinker import types

from tests.conformance.conftest import TINY
from tests.serverproc import API_KEY
from tinkerd.api import codec


def _key(data_dir, account: str, env: dict | None = None) -> str:
    """`env`: a PostgreSQL-backed server's (ServerProcess.cli_env), so that the key lands in its store."""
    out = subprocess.run([sys.executable, "-m", "tinkerd.cli.main", "keys", "--data-dir", str(data_dir), "create",
                          "--name", f"{account}-key", "--account", account], capture_output=True, text=True, check=True,
                         env=env)
    return out.stdout.split("TINKER_API_KEY=")[1].split()[0]


def _datum() -> types.Datum:
    return types.Datum(model_input=types.ModelInput.from_ints([1, 2, 3]), loss_fn_inputs={"target_tokens": [2, 3, 4]})


@pytest.fixture(scope="module")
def world(store_server):
    """A's run with every kind of thing on it; B's own client and key. On SQLite and on PostgreSQL."""
    server = store_server
    a = tinker.ServiceClient(base_url=server.url, api_key=API_KEY)
    key_b = _key(server.data_dir, "bob-ownership", server.cli_env())
    b = tinker.ServiceClient(base_url=server.url, api_key=key_b)
    tc = a.create_lora_training_client(base_model=TINY, rank=4).result()
    fb = tc.forward_backward([_datum()], "cross_entropy")
    fb.result()
    state = tc.save_state("own-a").result().path
    sampler = tc.save_weights_for_sampler("own-a-s").result().path
    external = tc.save_weights_external("own-a-e").result().path
    sc = a.create_sampling_client(model_path=sampler).result()
    sc.sample(types.ModelInput.from_ints([1, 2]), 1, types.SamplingParams(max_tokens=2)).result()
    return dict(a=a, b=b, key_b=key_b, tc=tc, state=state, sampler=sampler, external=external, sc=sc,
                request_id=fb.request_id if hasattr(fb, "request_id") else None, url=server.url)


def _b(world, method: str, path: str, **kw) -> httpx.Response:
    return httpx.request(method, f"{world['url']}/api/v1{path}", headers={"X-API-Key": world["key_b"]}, timeout=30, **kw)


def _is_404(r: httpx.Response) -> bool:
    return r.status_code == 404 and r.json()["category"] == "user"


def test_a_still_sees_its_own(world):
    rest = world["a"].create_rest_client()
    assert world["tc"].model_id in [r.training_run_id for r in rest.list_training_runs(limit=1000).result().training_runs]
    paths = [c.tinker_path for c in rest.list_user_checkpoints(limit=1000).result().checkpoints]
    assert {world["state"], world["sampler"], world["external"]} <= set(paths)


def test_listings_show_only_the_callers(world):
    rest = world["b"].create_rest_client()
    runs = rest.list_training_runs(limit=1000).result()
    assert world["tc"].model_id not in [r.training_run_id for r in runs.training_runs]
    ckpts = rest.list_user_checkpoints(limit=1000).result()
    assert not {c.tinker_path for c in ckpts.checkpoints} & {world["state"], world["sampler"], world["external"]}
    # B's own run shows up for B only.
    tcb = world["b"].create_lora_training_client(base_model=TINY, rank=4).result()
    assert [r.training_run_id for r in rest.list_training_runs(limit=1000).result().training_runs] == [tcb.model_id]
    assert tcb.model_id not in [r.training_run_id for r in
                                world["a"].create_rest_client().list_training_runs(limit=1000).result().training_runs]


def test_rest_get_delete_ttl_publish_are_404(world):
    rest = world["b"].create_rest_client()
    mid = world["tc"].model_id
    with pytest.raises(tinker.NotFoundError):
        rest.get_training_run(mid).result()
    with pytest.raises(tinker.NotFoundError):
        rest.list_checkpoints(mid).result()
    with pytest.raises(tinker.NotFoundError):
        rest.get_weights_info_by_tinker_path(world["state"]).result()
    with pytest.raises(tinker.NotFoundError):
        rest.get_external_weights_urls(world["external"]).result()
    for op in (rest.delete_checkpoint_from_tinker_path, rest.publish_checkpoint_from_tinker_path,
               rest.unpublish_checkpoint_from_tinker_path):
        with pytest.raises(tinker.NotFoundError):
            op(world["state"]).result()
    with pytest.raises(tinker.NotFoundError):
        rest.set_checkpoint_ttl_from_tinker_path(world["state"], 3600).result()
    # Exactly the answer of a missing id: nothing tells B the id exists.
    mine, missing = _b(world, "GET", f"/training_runs/{mid}"), _b(world, "GET", "/training_runs/sess-nope:train:0")
    assert _is_404(mine) and _is_404(missing)
    assert mine.json()["error"].replace(mid, "X") == missing.json()["error"].replace("sess-nope:train:0", "X")
    # A's checkpoints are all still there.
    paths = [c.tinker_path for c in world["a"].create_rest_client().list_user_checkpoints(limit=1000).result().checkpoints]
    assert {world["state"], world["sampler"], world["external"]} <= set(paths)


def test_load_and_sample_from_a_path_are_404(world):
    b = world["b"]
    with pytest.raises(tinker.NotFoundError):
        b.create_training_client_from_state(world["state"]).result()
    with pytest.raises(tinker.NotFoundError):
        b.create_sampling_client(model_path=world["sampler"]).result().sample(
            types.ModelInput.from_ints([1]), 1, types.SamplingParams(max_tokens=1)).result()
    sid = world["sc"]._sampling_session_id if hasattr(world["sc"], "_sampling_session_id") else None
    if sid:
        body = {"sampling_session_id": sid, "seq_id": 0, "num_samples": 1, "prompt": {"chunks": [
            {"type": "encoded_text", "tokens": [1]}]}, "sampling_params": {"max_tokens": 1}}
        assert _is_404(_b(world, "POST", "/asample", json=body))
        assert _is_404(_b(world, "GET", f"/samplers/{sid}"))
    body = {"model_path": world["sampler"], "num_samples": 1, "prompt": {"chunks": [
        {"type": "encoded_text", "tokens": [1]}]}, "sampling_params": {"max_tokens": 1}}
    assert _is_404(_b(world, "POST", "/asample", json=body))


def test_training_ops_on_a_model_are_404(world):
    mid = world["tc"].model_id
    assert _is_404(_b(world, "POST", "/get_info", json={"model_id": mid}))
    assert _is_404(_b(world, "POST", "/optim_step", json={"model_id": mid, "seq_id": 99,
                                                           "adam_params": {"learning_rate": 1e-3}}))
    assert _is_404(_b(world, "POST", "/save_weights", json={"model_id": mid, "seq_id": 99, "path": "stolen"}))
    assert _is_404(_b(world, "POST", "/save_weights_for_sampler", json={"model_id": mid, "seq_id": 99, "path": "stolen"}))
    assert _is_404(_b(world, "POST", "/save_weights_external", json={"model_id": mid, "seq_id": 99, "path": "stolen"}))
    assert _is_404(_b(world, "POST", "/load_weights", json={"model_id": mid, "seq_id": 99, "path": world["state"], "optimizer": False}))
    # forward_backward through the SDK: B's client pointed at A's model_id.
    tcb = world["b"].create_lora_training_client(base_model=TINY, rank=4).result()
    tcb.model_id = mid
    with pytest.raises(tinker.NotFoundError):
        tcb.forward_backward([_datum()], "cross_entropy").result()
    # A's session cannot be used by B to create runs or samplers in it.
    sess = mid.split(":")[0]
    assert _is_404(_b(world, "POST", "/create_model", json={"session_id": sess, "model_seq_id": 77, "base_model": TINY,
                                                             "lora_config": {"rank": 4}}))
    assert _is_404(_b(world, "POST", "/create_sampling_session", json={"session_id": sess, "sampling_session_seq_id": 77,
                                                                        "base_model": TINY}))
    assert _is_404(_b(world, "POST", "/session_heartbeat", json={"session_id": sess}))


def test_retrieve_future_of_a_request_is_404(world):
    a_headers = {"X-API-Key": API_KEY}
    api = f"{world['url']}/api/v1"
    sess = httpx.post(f"{api}/create_session", headers=a_headers, timeout=30,
                      json={"tags": [], "user_metadata": {}, "sdk_version": "0.38.0"}).json()["session_id"]
    r = httpx.post(f"{api}/create_model", headers=a_headers, timeout=30,
                   json={"session_id": sess, "model_seq_id": 0, "base_model": TINY, "lora_config": {"rank": 4}})
    request_id = r.json()["request_id"]
    mine = _b(world, "POST", "/retrieve_future", json={"request_id": request_id})
    assert _is_404(mine) and "unknown request_id" in mine.json()["error"]
    theirs = httpx.post(f"{world['url']}/api/v1/retrieve_future", headers=a_headers, timeout=60,
                        json={"request_id": request_id})
    assert theirs.status_code == 200 and theirs.json()["type"] == "create_model"


def test_signed_urls_stay_capabilities(world):
    """The file URLs themselves need no key (the signature is the credential), but only A can mint them."""
    urls = world["a"].create_rest_client().get_external_weights_urls(world["external"]).result().urls
    url = next(iter(urls.values()))
    assert httpx.get(url, timeout=30).status_code == 200


def test_same_seq_id_on_a_shared_base_model_stays_per_account(world):
    """Raw asample by base_model: A's and B's requests with equal seq_ids are two futures, each its owner's.

    The base model is shared, so a (target, seq_id) dedupe without the account handed B A's request id
    (and B then got 404 for it).
    """
    body = {"base_model": TINY, "prompt": {"chunks": [{"type": "encoded_text", "tokens": [1, 2, 3]}]},
            "num_samples": 1, "sampling_params": {"max_tokens": 2, "temperature": 0.0}, "seq_id": 7,
            "type": "sample"}
    headers = {"a": {"X-API-Key": API_KEY}, "b": {"X-API-Key": world["key_b"]}}
    ids = {}
    for who in ("a", "b"):
        r = httpx.post(f"{world['url']}/api/v1/asample", json=body, headers=headers[who], timeout=30)
        assert r.status_code == 200, r.text
        ids[who] = r.json()["request_id"]
    assert ids["a"] != ids["b"]
    for who in ("a", "b"):
        while True:
            r = httpx.post(f"{world['url']}/api/v1/retrieve_future", json={"request_id": ids[who]},
                           headers=headers[who], timeout=60)
            if r.status_code == 408 and r.json().get("type") == "try_again":  # the long-poll hold passed
                continue
            assert r.status_code == 200, r.text
            break
        done = codec.pb.SampleResponse.FromString(r.content)  # results travel as protobuf
        assert len(np.frombuffer(done.sequences[0].tokens, dtype=np.int32)) == 2
    # A re-send by A is still A's original future.
    r = httpx.post(f"{world['url']}/api/v1/asample", json=body, headers=headers["a"], timeout=30)
    assert r.json()["request_id"] == ids["a"]
