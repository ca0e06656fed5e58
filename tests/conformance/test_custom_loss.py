"""Server-side custom losses through the unmodified SDK 0.38: `create_custom_loss` uploads the traced
loss (the server advertises custom_loss_server_side) and `forward_backward_custom` runs it on the
server in one pass. It must give what the SDK's own client-side path gives, the two-pass path the
SDK takes when a server does not run custom losses: the same loss, metrics and logprobs, and the
same LoRA weights after optim_step. Hostile graphs are user 400s and the server carries on.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import signal
import socket

import httpx
import numpy as np
import pytest
import tinker
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from tinker import types
from tinker.lib.public_interfaces.custom_loss import encode_graph, trace_loss

from tests.conformance.conftest import TINY
from tests.serverproc import API_KEY, start_server

HEADERS = {"X-API-Key": API_KEY}
SMOOTH_ADAM = types.AdamParams(learning_rate=1e-2, eps=1.0)


def dpo(logprobs, weights, ref_logprobs, beta):
    """DPO on one datum holding both completions: weights +1 on chosen, -1 on rejected targets."""
    margin = beta * (weights * (logprobs - ref_logprobs)).sum()
    return -F.logsigmoid(margin), {"custom/margin:mean": margin.detach(), "custom/acc:mean": (margin > 0).float()}


def soft_topk(logprobs, target_distribution):
    """[T, K] logprobs against a [T, K] soft target plus an entropy term over the K candidates."""
    p = torch.softmax(logprobs, dim=-1)
    entropy = -(p * torch.log_softmax(logprobs, -1)).sum(dim=-1).mean()
    return -(target_distribution * logprobs).sum() - 0.01 * entropy, {"custom/entropy:mean": entropy}


def _data(case: str, rng) -> list[types.Datum]:
    data = []
    for n in (9, 6, 7):
        tokens = rng.integers(0, 150_000, n + 1).tolist()
        if case == "dpo":
            inputs = {
                "target_tokens": types.TensorData.from_numpy(np.array(tokens[1:], np.int64)),
                "weights": types.TensorData.from_numpy(rng.choice([-1.0, 1.0], n).astype(np.float32)),
                "ref_logprobs": types.TensorData.from_numpy((-rng.random(n) * 12).astype(np.float32)),
                "beta": types.TensorData(data=[0.1], dtype="float32", shape=[]),
            }
        else:
            targets = rng.integers(0, 150_000, (n, 3)).astype(np.int64)
            targets[:, 0] = tokens[1:]
            dist = rng.random((n, 3)).astype(np.float32)
            inputs = {"target_tokens": types.TensorData.from_numpy(targets),
                      "target_distribution": types.TensorData.from_numpy(dist / dist.sum(-1, keepdims=True))}
        data.append(types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs=inputs))
    return data


CASES = {"dpo": (dpo, {"logprobs": 1, "weights": 1, "ref_logprobs": 1, "beta": 0}),
         "soft_topk": (soft_topk, {"logprobs": 2, "target_distribution": 2})}


def _weights(server, tc, name: str) -> dict[str, torch.Tensor]:
    tc.save_state(name).result()
    (path,) = server.data_dir.rglob(f"{name}/adapter_model.safetensors")
    return load_file(path)


@pytest.mark.parametrize("case", sorted(CASES))
def test_server_side_custom_loss_equals_the_sdk_client_side_path(server, service_client, case):
    fn, ranks = CASES[case]
    handle = service_client.create_custom_loss(fn, ranks).result()
    assert handle.loss_id is not None  # uploaded: the server advertised custom_loss_server_side
    # The same traced loss without an id is what the SDK runs client-side (forward, then a
    # cross_entropy backward with weights = -dL/dlogprobs).
    local = dataclasses.replace(handle, loss_id=None)
    data = _data(case, np.random.default_rng(7))

    server_side = service_client.create_lora_training_client(base_model=TINY, rank=4, seed=31).result()
    client_side = service_client.create_lora_training_client(base_model=TINY, rank=4, seed=31).result()
    before = _weights(server, server_side, f"cl-{case}-before")
    ours = server_side.forward_backward_custom(data, handle)
    server_side.optim_step(SMOOTH_ADAM)
    reference = client_side.forward_backward_custom(data, local)
    client_side.optim_step(SMOOTH_ADAM)
    ours, reference = ours.result(), reference.result()

    assert "surrogate_loss:sum" not in ours.metrics  # one server pass, no client-side surrogate
    assert "surrogate_loss:sum" in reference.metrics
    reference.metrics.pop("surrogate_loss:sum")
    assert set(ours.metrics) == set(reference.metrics) and any(k.startswith("custom/") for k in ours.metrics)
    for key, value in reference.metrics.items():
        assert ours.metrics[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key
    for a, b in zip(ours.loss_fn_outputs, reference.loss_fn_outputs):
        np.testing.assert_array_equal(a["logprobs"].to_numpy(), b["logprobs"].to_numpy())

    after_ours = _weights(server, server_side, f"cl-{case}-server")
    after_reference = _weights(server, client_side, f"cl-{case}-client")
    assert after_ours.keys() == after_reference.keys() == before.keys()
    moved = max(float((after_reference[k] - before[k]).abs().max()) for k in before)
    assert moved > 1e-3, moved  # the step really moved the weights, far beyond the tolerance below
    for key in before:
        torch.testing.assert_close(after_ours[key], after_reference[key], rtol=0, atol=1e-6)


def _post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}/api/v1/{path}", json=body, headers=HEADERS, timeout=60)


def _upload(session_id: str, seq: int, graph: dict, inputs=({"name": "logprobs", "rank": 1},)) -> dict:
    return {"session_id": session_id, "custom_loss_seq_id": seq, "name": "neg_ll", "inputs": list(inputs),
            "graph": graph, "type": "create_custom_loss"}


def neg_ll(logprobs):
    loss = -logprobs.sum()
    return loss, {"custom/neg_ll:sum": loss}


def _hostile(graph: dict, how: str) -> dict:
    g = copy.deepcopy(graph)
    nodes = g["nodes"]
    if how == "disallowed op":
        nodes[1].update(op="call_function", target="builtins.eval")
    elif how == "attribute access":
        nodes.insert(1, {"op": "call_function", "name": "cls", "target": "getattr", "args": [{"ref": "logprobs"}, "__class__"]})
    elif how == "huge node count":
        nodes[1:1] = [{"op": "call_function", "name": f"n{i}", "target": "operator.neg", "args": [{"ref": "logprobs"}]}
                      for i in range(5000)]
    elif how == "cycle":
        nodes[1]["args"] = [{"ref": nodes[2]["name"]}]
    elif how == "wrong dtype":
        nodes[1]["args"].append({"dtype": "complex128"})
    elif how == "huge constant":
        nodes[1]["args"].append(list(range(100_000)))
    return g


def test_hostile_graphs_are_user_400s_and_the_server_carries_on(server, service_client):
    session_id = _post(server, "create_session", {"tags": [], "user_metadata": None, "sdk_version": "0.38.0", "type": "create_session"}).json()["session_id"]
    graph = encode_graph(trace_loss(neg_ll, {"logprobs": 1}, session_id)).model_dump(mode="json")
    for seq, (how, words) in enumerate({
        "disallowed op": "'builtins.eval', which is not on this server's list",
        "attribute access": "reads attribute '__class__'",
        "huge node count": "at most 1024 are allowed",
        "cycle": "which is not an earlier node",
        "wrong dtype": "dtype 'complex128' is not allowed",
        "huge constant": "more than 4096 values",
    }.items()):
        r = _post(server, "create_custom_loss", _upload(session_id, seq, _hostile(graph, how)))
        assert r.status_code == 400, (how, r.text)
        assert r.json()["category"] == "user" and words in r.json()["error"], (how, r.json())
    r = _post(server, "create_custom_loss", _upload(session_id, 0, graph, [{"name": "logprobs", "rank": 0}]))
    assert r.status_code == 400 and "logprobs has rank 1" in r.json()["error"], r.text

    # The server carries on: a good upload works, idempotently on custom_loss_seq_id.
    ids = []
    for _ in range(2):
        r = _post(server, "create_custom_loss", _upload(session_id, 7, graph))
        assert r.status_code == 200, r.text
        done = _post(server, "retrieve_future", {"request_id": r.json()["request_id"]})
        assert done.status_code == 200, done.text
        ids.append(types.CreateCustomLossResponse.model_validate(done.json()).loss_id)
    assert ids[0] == ids[1]
    other = _hostile(graph, "none")
    other["nodes"][1]["target"] = "mean"  # a different, allowed loss under the same seq_id
    r = _post(server, "create_custom_loss", _upload(session_id, 7, other))
    assert r.status_code == 400 and "already names a different loss" in r.json()["error"], r.text
    assert httpx.get(f"{server.url}/api/v1/healthz").status_code == 200


def test_a_disallowed_function_fails_create_custom_loss_through_the_sdk(service_client):
    def uses_linalg(logprobs):
        loss = torch.linalg.vector_norm(logprobs)
        return loss, {}

    with pytest.raises(tinker.BadRequestError, match="torch._C._linalg.linalg_vector_norm.*not on this server.s list"):
        service_client.create_custom_loss(uses_linalg, {"logprobs": 1}).result()


def test_a_loss_of_another_session_is_refused_by_the_server(server, service_client):
    handle = service_client.create_custom_loss(neg_ll, {"logprobs": 1}).result()
    other = tinker.ServiceClient(base_url=server.url, api_key=API_KEY)
    tc = other.create_lora_training_client(base_model=TINY, rank=4).result()
    datum = types.Datum(model_input=types.ModelInput.from_ints([1, 2, 3]), loss_fn_inputs={"target_tokens": [2, 3, 4]})
    # The SDK refuses a foreign handle itself; past that check, the server does too.
    with pytest.raises(ValueError, match="only be used by clients of that session"):
        tc.forward_backward_custom([datum], handle)
    smuggled = dataclasses.replace(handle, session_id=other.holder.get_session_id())
    with pytest.raises(tinker.BadRequestError, match="was not created by this training run's session"):
        tc.forward_backward_custom([datum], smuggled).result()


def test_a_restart_replays_server_side_custom_loss_steps_exactly(tmp_path):
    """Recovery rebuilds a run from its logged forward_backward requests; a custom one names its loss
    by id, which the stored row resolves again: after a SIGKILL the run goes on as if uninterrupted."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    # No snapshot after the first: the restart must replay every later custom step from the log.
    args = ["--threads", "1", "--snapshot-interval-s", "3600", "--port", port]
    srv = start_server(tmp_path, [TINY], args)
    data = _data("dpo", np.random.default_rng(3))

    def train(tc, handle, n):
        out = []
        for _ in range(n):
            fb = tc.forward_backward_custom(data, handle)
            tc.optim_step(SMOOTH_ADAM).result()
            out.append(fb.result().metrics["loss:sum"])
        return out

    try:
        sc = tinker.ServiceClient(base_url=srv.url, api_key=API_KEY)
        handle = sc.create_custom_loss(dpo, CASES["dpo"][1]).result()
        reference = train(sc.create_lora_training_client(base_model=TINY, rank=4, seed=2).result(), handle, 5)
        tc = sc.create_lora_training_client(base_model=TINY, rank=4, seed=2).result()
        first = train(tc, handle, 3)
        os.kill(srv.proc.pid, signal.SIGKILL)
        srv.proc.wait()
        srv = start_server(tmp_path, [TINY], args)
        rest = train(tc, handle, 2)  # the same client: its session, loss handle and seq_ids go on
        recovered = [line for line in srv.lines if "server recovered" in line]
        assert recovered and " from 0 ops" not in recovered[0], srv.lines
    finally:
        srv.stop()
    assert first + rest == reference
    assert reference[-1] < reference[0]  # it trained
