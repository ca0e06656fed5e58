"""Numbers are checked where they enter (api/limits.py) and, last, by the engine (engine/finite.py):
every bad number is a `user` error, never a 5xx, and a run that was sent them trains on exactly as
an undisturbed twin does."""

from __future__ import annotations

import json
import math

import httpx
import numpy as np
import pytest
import tinker
from tinker import types
from tinker.proto import tinker_public_pb2 as pb

from tests.conformance.conftest import TINY
from tests.serverproc import API_KEY

HEADERS = {"X-API-Key": API_KEY, "Content-Type": "application/json"}
INT64_EDGES = (2**63, -(2**63) - 1, 2**64)
SEQ = 10**9  # a valid seq_id for raw requests, so the bad number is the only problem


def _datum(tokens, weight: float = 1.0) -> types.Datum:
    targets = tokens[1:] + [tokens[0]]
    return types.Datum(model_input=types.ModelInput.from_ints(tokens),
                       loss_fn_inputs={"target_tokens": targets, "weights": [weight] * len(targets)})


DATA = [_datum([5, 6, 7, 8, 9, 10]), _datum([11, 12, 13, 14])]


def _user_error(call) -> str:
    """The message of the user error `call()` must raise: a 400, or a failed future of category user."""
    try:
        call()
    except tinker.BadRequestError as e:
        return str(e)
    except tinker.RequestFailedError as e:
        assert e.category == "user", e
        return e.message
    raise AssertionError("accepted")


def _post(server, path: str, body) -> httpx.Response:
    content = json.dumps(body, allow_nan=True).encode()  # inf goes out as Infinity, NaN as NaN
    return httpx.post(f"{server.url}/api/v1{path}", content=content, headers=HEADERS, timeout=60)


def _assert_400(r: httpx.Response, *words: str) -> None:
    assert r.status_code == 400, (r.status_code, r.text)
    assert r.json()["category"] == "user", r.text
    for w in words:
        assert w in r.json()["error"], r.text


def _step(client) -> float:
    loss = client.forward_backward(DATA, "cross_entropy").result().metrics["loss:sum"]
    client.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    return loss


@pytest.fixture(scope="module")
def twins(server):
    sc = tinker.ServiceClient(base_url=server.url, api_key=API_KEY)
    subject = sc.create_lora_training_client(base_model=TINY, rank=4, seed=3).result()
    twin = sc.create_lora_training_client(base_model=TINY, rank=4, seed=3).result()
    return sc, subject, twin


def test_bad_numbers_are_user_errors_and_the_run_trains_on_as_its_twin(server, twins):
    sc, subject, twin = twins
    assert _step(subject) == _step(twin)
    # Pending gradients on both: refused ops in between must keep them as they are.
    subject.forward_backward(DATA, "cross_entropy").result()
    twin.forward_backward(DATA, "cross_entropy").result()

    mid = subject.model_id
    for adam, field in [({"learning_rate": math.inf}, "learning_rate"), ({"learning_rate": math.nan}, "learning_rate"),
                        ({"learning_rate": -1.0}, "learning_rate"), ({"eps": 0.0}, "eps"),
                        ({"weight_decay": math.inf}, "weight_decay"), ({"weight_decay": 1e300}, "weight_decay"),
                        ({"beta1": 1.0}, "beta1"), ({"beta2": -0.1}, "beta2"), ({"grad_clip_norm": math.inf}, "grad_clip_norm")]:
        _assert_400(_post(server, "/optim_step", {"model_id": mid, "seq_id": SEQ, "adam_params": adam}), field)
    # Through the SDK: refused at the edge, or (finite but overflowing fp32) by the engine's guard.
    for adam in (types.AdamParams(learning_rate=-1.0), types.AdamParams(eps=0.0),
                 types.AdamParams(weight_decay=1e300), types.AdamParams(learning_rate=1e39)):
        _user_error(lambda: subject.optim_step(adam).result())
    assert "loss is inf for datum 1" in _user_error(
        lambda: subject.forward_backward([DATA[0], _datum([1, 2, 3], weight=3e38)], "cross_entropy").result())
    assert "NaN or infinite" in _user_error(
        lambda: subject.forward_backward([_datum([1, 2, 3], weight=math.inf)], "cross_entropy").result())
    for name in ("", "a/b", "..", "x\x00y", "n" * 300):
        assert "path" in _user_error(lambda: subject.save_state(name).result()), name
        assert "path" in _user_error(lambda: subject.save_weights_for_sampler(name).result()), name

    sampler = sc.create_sampling_client(base_model=TINY)
    prompt = types.ModelInput.from_ints([1, 2, 3])
    for params, field in [(types.SamplingParams(max_tokens=4, top_k=2**63), "top_k"),
                          (types.SamplingParams(max_tokens=4, temperature=-1.0), "temperature"),
                          (types.SamplingParams(max_tokens=4, top_p=0.0), "top_p"),
                          (types.SamplingParams(max_tokens=0), "max_tokens"),
                          (types.SamplingParams(max_tokens=4, seed=2**64), "seed")]:
        assert field in _user_error(lambda: sampler.sample(prompt, 1, params).result()), field

    # The refused ops changed nothing: both apply their pending gradient and go on identically.
    subject.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    twin.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    assert [_step(subject) for _ in range(3)] == [_step(twin) for _ in range(3)]


def _fwdbwd(model_id: str, seq_id: int) -> bytes:
    msg = pb.ForwardBackwardRequest(model_id=model_id, seq_id=seq_id, loss_fn="cross_entropy")
    d = msg.data.add()
    d.model_input.add().encoded_text.tokens = np.array([1, 2, 3], dtype=np.int32).tobytes()
    t = d.loss_fn_inputs["target_tokens"]
    t.dense, t.dtype = np.array([2, 3, 4], dtype=np.int64).tobytes(), pb.DTYPE_INT64
    t.shape.append(3)
    return msg.SerializeToString()


def test_int64_edges_are_400_never_5xx(server, twins):
    _, subject, _ = twins
    session = _post(server, "/create_session", {"tags": [], "user_metadata": {}, "sdk_version": "0.38.0"}).json()["session_id"]
    prompt = {"chunks": [{"type": "encoded_text", "tokens": [1, 2, 3]}]}
    for n in (*INT64_EDGES, -1):
        _assert_400(_post(server, "/optim_step", {"model_id": subject.model_id, "seq_id": n,
                                                  "adam_params": {"learning_rate": 1e-3}}), "seq_id")
        _assert_400(_post(server, "/create_model", {"session_id": session, "model_seq_id": n, "base_model": TINY,
                                                    "lora_config": {"rank": 4}}), "model_seq_id")
        _assert_400(_post(server, "/create_sampling_session", {"session_id": session, "sampling_session_seq_id": n,
                                                               "base_model": TINY}), "sampling_session_seq_id")
        _assert_400(_post(server, "/save_weights", {"model_id": subject.model_id, "seq_id": n, "path": "edge"}), "seq_id")
        _assert_400(_post(server, "/asample", {"base_model": TINY, "seq_id": n, "prompt": prompt, "num_samples": 1,
                                               "sampling_params": {"max_tokens": 2}}), "seq_id")
        for route in ("/checkpoints", "/training_runs"):
            for param in ("offset", "limit"):
                r = httpx.get(f"{server.url}/api/v1{route}", params={param: n}, headers=HEADERS, timeout=60)
                _assert_400(r, param)
    for top_k in (2**63, 2**64, -2):
        _assert_400(_post(server, "/asample", {"base_model": TINY, "prompt": prompt, "num_samples": 1,
                                               "sampling_params": {"max_tokens": 2, "top_k": top_k}}), "top_k")
    _assert_400(_post(server, "/asample", {"base_model": TINY, "prompt": {"chunks": [
        {"type": "encoded_text", "tokens": [1, 2**63]}]}, "num_samples": 1, "sampling_params": {"max_tokens": 2}}),
        "prompt token id")
    # forward_backward's seq_id is an int32 on the wire: only a negative one is out of range.
    r = httpx.post(f"{server.url}/api/v1/forward_backward", content=_fwdbwd(subject.model_id, -1),
                   headers={**HEADERS, "Content-Type": "application/x-protobuf"}, timeout=60)
    _assert_400(r, "seq_id")
    # save_weights with neither a path nor a seq_id once wrote weights/step-None.
    _assert_400(_post(server, "/save_weights", {"model_id": subject.model_id}), "path")
