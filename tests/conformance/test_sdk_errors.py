"""Bad input fails its own request with a `user` error, never a retried 5xx, and harms nothing else."""

from __future__ import annotations

import httpx
import numpy as np
import pytest
import tinker
import zstandard
from tinker import types
from tinker.proto import tinker_public_pb2 as pb

from tests.conformance.conftest import TINY
from tests.conformance.refusals import failed_as_user
from tests.serverproc import API_KEY

HEADERS = {"X-API-Key": API_KEY}


def _datum(tokens, targets=None, weights=None):
    targets = targets if targets is not None else tokens[1:] + [0]
    inputs = {"target_tokens": targets, "weights": weights if weights is not None else [1.0] * len(targets)}
    return types.Datum(model_input=types.ModelInput.from_ints(tokens), loss_fn_inputs=inputs)


@pytest.fixture(scope="module")
def clients(server):
    sc = tinker.ServiceClient(base_url=server.url, api_key=API_KEY)
    victim = sc.create_lora_training_client(base_model=TINY, rank=4, seed=1).result()
    attacker = sc.create_lora_training_client(base_model=TINY, rank=4, seed=1).result()
    return sc, victim, attacker


def test_bad_datums_fail_their_own_future_only(clients):
    _, victim, attacker = clients
    good = [_datum([1, 2, 3, 4])]
    victim_before = victim.forward(good, "cross_entropy").result().metrics["loss:sum"]
    attacker_before = attacker.forward(good, "cross_entropy").result().metrics["loss:sum"]

    failed_as_user(attacker.forward_backward([_datum([1, 2, 10**9])], "cross_entropy"), "vocab")
    failed_as_user(attacker.forward_backward([_datum([1, 2, 3], targets=[2, 3])], "cross_entropy"), "target_tokens")
    failed_as_user(attacker.forward_backward([_datum([1, 2, 3], weights=[1.0, 1.0])], "cross_entropy"), "weights")
    failed_as_user(attacker.forward_backward([_datum([1, 2, 3], targets=[2, 3, -5])], "cross_entropy"), "vocab")

    # The failed requests left no gradient behind: a step now changes nothing (zero grads, no weight
    # decay), and both adapters still compute exactly what they did before.
    attacker.optim_step(types.AdamParams(learning_rate=0.1)).result()
    assert attacker.forward(good, "cross_entropy").result().metrics["loss:sum"] == attacker_before
    assert victim.forward(good, "cross_entropy").result().metrics["loss:sum"] == victim_before


def _fwdbwd_proto(model_id: str, seq_id: int, loss_fn: str = "cross_entropy") -> bytes:
    msg = pb.ForwardBackwardRequest(model_id=model_id, seq_id=seq_id, loss_fn=loss_fn)
    d = msg.data.add()
    d.model_input.add().encoded_text.tokens = np.array([1, 2, 3], dtype=np.int32).tobytes()
    t = d.loss_fn_inputs["target_tokens"]
    t.dense, t.dtype = np.array([2, 3, 4], dtype=np.int64).tobytes(), pb.DTYPE_INT64
    t.shape.append(3)
    return msg.SerializeToString()


def _poll(url: str, request_id: str) -> httpx.Response:
    for _ in range(50):
        r = httpx.post(f"{url}/api/v1/retrieve_future", json={"request_id": request_id}, headers=HEADERS, timeout=60)
        if r.headers["content-type"].startswith("application/json") and r.json().get("type") == "try_again":
            continue
        return r
    raise AssertionError("future never finished")


def test_unknown_loss_is_a_user_error_not_a_fallback(server, clients):
    _, _, attacker = clients
    body = _fwdbwd_proto(attacker.model_id, 10_000, loss_fn="no_such_loss")
    r = httpx.post(f"{server.url}/api/v1/forward_backward", content=body,
                   headers={**HEADERS, "Content-Type": "application/x-protobuf"})
    assert r.status_code == 200
    result = _poll(server.url, r.json()["request_id"]).json()
    assert result["category"] == "user" and "no_such_loss" in result["error"] and "cross_entropy" in result["error"]


def test_wrong_model_id_is_404_user(server):
    body = _fwdbwd_proto("sess-nope:train:0", 1)
    r = httpx.post(f"{server.url}/api/v1/forward_backward", content=body,
                   headers={**HEADERS, "Content-Type": "application/x-protobuf"})
    assert r.status_code == 404 and r.json()["category"] == "user"
    r = httpx.post(f"{server.url}/api/v1/optim_step", headers=HEADERS,
                   json={"model_id": "sess-nope:train:0", "seq_id": 1, "adam_params": {"learning_rate": 1e-3}})
    assert r.status_code == 404 and r.json()["category"] == "user"


def test_malformed_bodies_are_400(server):
    r = httpx.post(f"{server.url}/api/v1/forward_backward", content=b"\xff\xff\xff\x00garbage",
                   headers={**HEADERS, "Content-Type": "application/x-protobuf"})
    assert r.status_code == 400 and r.json()["category"] == "user"
    r = httpx.post(f"{server.url}/api/v1/optim_step", content=b"{not json", headers=HEADERS)
    assert r.status_code == 400 and r.json()["category"] == "user"
    r = httpx.post(f"{server.url}/api/v1/create_model", headers=HEADERS,
                   json={"session_id": "x", "model_seq_id": 0, "base_model": TINY, "lora_config": {"rank": "eight"}})
    assert r.status_code == 400


def test_oversized_and_zstd_bomb_bodies_are_413(server):
    bomb = zstandard.ZstdCompressor().compress(b"\0" * (65 * 1024 * 1024))
    assert len(bomb) < 100_000
    r = httpx.post(f"{server.url}/api/v1/forward_backward", content=bomb,
                   headers={**HEADERS, "Content-Type": "application/x-protobuf", "Content-Encoding": "zstd"})
    assert r.status_code == 413 and r.json()["category"] == "user"
    big = b"\0" * (65 * 1024 * 1024)
    r = httpx.post(f"{server.url}/api/v1/forward_backward", content=big,
                   headers={**HEADERS, "Content-Type": "application/x-protobuf"})
    assert r.status_code == 413


def test_unserved_base_model_and_bad_rank(service_client):
    with pytest.raises(tinker.BadRequestError, match="not served"):
        service_client.create_lora_training_client(base_model="nobody/nothing", rank=4).result()
    with pytest.raises(tinker.BadRequestError, match="rank"):
        service_client.create_lora_training_client(base_model=TINY, rank=100_000).result()


def test_missing_and_wrong_api_key(server):
    r = httpx.post(f"{server.url}/api/v1/create_session", json={"tags": [], "sdk_version": "0.38.0"})
    assert r.status_code == 401
    r = httpx.post(f"{server.url}/api/v1/create_session", json={"tags": [], "sdk_version": "0.38.0"},
                   headers={"X-API-Key": "tml-wrong"})
    assert r.status_code == 401


def test_resent_request_returns_the_original_future(server, clients):
    _, _, attacker = clients
    body = _fwdbwd_proto(attacker.model_id, 20_000)
    headers = {**HEADERS, "Content-Type": "application/x-protobuf"}
    first = httpx.post(f"{server.url}/api/v1/forward_backward", content=body, headers=headers).json()
    again = httpx.post(f"{server.url}/api/v1/forward_backward", content=body, headers=headers).json()
    assert first["request_id"] == again["request_id"]
