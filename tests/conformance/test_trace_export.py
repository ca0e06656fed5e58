"""`RestClient.export_session_trace` and `tinker session export-trace` against tinkerd: a signed URL
(no credentials needed to fetch it) to the session's ops as a trace, each op with its timings,
queue wait, engine time and sizes; another account's session is a 404, a forged or expired link a 403."""

from __future__ import annotations

import json

import httpx
import pytest
import tinker
from tinker import types

from tests.conformance.conftest import TINY
from tests.conformance.test_auth_cli import _tinker
from tests.conformance.test_ownership import _key
from tinkerd.control.tokens import Tokens


@pytest.fixture(scope="module")
def traced(server):
    key = _key(server.data_dir, "rita-trace")
    sc = tinker.ServiceClient(base_url=server.url, api_key=key)
    tc = sc.create_lora_training_client(base_model=TINY, rank=4).result()
    datum = types.Datum(model_input=types.ModelInput.from_ints([1, 2, 3, 4]), loss_fn_inputs={"target_tokens": [2, 3, 4, 5]})
    tc.forward_backward([datum], "cross_entropy").result()
    tc.optim_step(types.AdamParams(learning_rate=1e-3)).result()
    sampler = tc.save_weights_and_get_sampling_client().result()
    sampler.sample(types.ModelInput.from_ints([1, 2, 3]), 2, types.SamplingParams(max_tokens=3)).result()
    return dict(key=key, session_id=sc.holder.get_session_id(), model_id=tc.model_id,
                sampler_id=sampler._sampling_session_id, rest=tinker.RestClient(base_url=server.url, api_key=key))


def test_the_trace_holds_every_op_with_its_timings_and_sizes(traced):
    url = traced["rest"].export_session_trace(traced["session_id"]).result()
    r = httpx.get(url, timeout=30)  # no X-API-Key: the signed URL is the credential
    assert r.status_code == 200, r.text
    events = r.json()["traceEvents"]
    names = {e["tid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    assert set(names.values()) == {f"training run {traced['model_id']}", f"sampling session {traced['sampler_id']}"}
    ops = [e for e in events if e["ph"] == "X" and "request_id" in e.get("args", {})]
    by_kind = {e["name"]: e for e in ops}
    assert {"CreateModel", "ForwardBackward", "OptimStep", "SaveWeightsForSampler", "Sample"} <= set(by_kind)
    fb, sample = by_kind["ForwardBackward"], by_kind["Sample"]
    assert names[fb["tid"]].startswith("training run") and names[sample["tid"]].startswith("sampling session")
    assert fb["args"]["status"] == "complete" and fb["args"]["request_bytes"] > 0 and fb["args"]["result_bytes"] > 0
    assert fb["args"]["trained_tokens"] == 4 and sample["args"]["sampled_tokens"] == 6
    assert [e["ts"] for e in ops] == sorted(e["ts"] for e in ops)
    for op in (fb, sample):
        inner = [e for e in events if e["ph"] == "X" and e["name"] in ("queued", "engine") and e["tid"] == op["tid"]
                 and op["ts"] <= e["ts"] and e["ts"] + e["dur"] <= op["ts"] + op["dur"]]
        assert {e["name"] for e in inner} >= {"engine"}


def test_the_cli_downloads_it(server, traced, tmp_path):
    out_file = tmp_path / "t.pftrace"
    out = _tinker(tmp_path, server, "session", "export-trace", traced["session_id"], "-o", str(out_file),
                  key=traced["key"])
    assert out.returncode == 0, out.stderr + out.stdout
    assert any(e.get("name") == "OptimStep" for e in json.loads(out_file.read_text())["traceEvents"])


def test_foreign_sessions_and_bad_links(server, traced):
    other = tinker.RestClient(base_url=server.url, api_key=_key(server.data_dir, "sam-trace"))
    for sid in (traced["session_id"], "sess-0000000000000000"):
        with pytest.raises(tinker.NotFoundError):
            other.export_session_trace(sid).result()
    url = traced["rest"].export_session_trace(traced["session_id"]).result()
    base, token = url.rsplit("/", 1)
    tokens = Tokens.in_dir(server.data_dir)
    expired = tokens.sign_url_token("trace_export", {"session_id": traced["session_id"]}, -10)
    auth_jwt = httpx.post(f"{server.url}/api/v1/auth/token", json={}, headers={"X-API-Key": traced["key"]}).json()["jwt"]
    for bad in (token[:-3] + "abc", expired, auth_jwt, "nonsense"):
        r = httpx.get(f"{base}/{bad}", timeout=30)
        assert r.status_code == 403 and r.json()["category"] == "user", r.text
    # Nor is a link a credential.
    assert httpx.get(f"{server.url}/api/v1/sessions", headers={"X-API-Key": token}).status_code == 401
