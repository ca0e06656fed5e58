"""A bounded fuzz of the HTTP API against a live `tinkerd serve`, with a valid key.

Three generators, each stopped by a wall-clock budget (all of it well under a minute):
1. schemathesis over the server's own OpenAPI schema (/openapi.json), positive and negative cases.
   The routes read their bodies themselves, so FastAPI's schema declares none: the SDK's pydantic
   request types are grafted in as the request bodies (tinkerd's wire schema is the SDK's).
2. hypothesis-built protobuf ForwardBackwardRequest bodies (odd dtypes, shapes, byte lengths,
   token ids, sparse indices, losses and configs), mutated protobuf and plain random bytes, also
   zstd-encoded, to /forward_backward.
3. hypothesis mutations of valid JSON bodies that name real ids (the fuzzing account's own session,
   run and sampler, and another account's run), so generated values reach validation deep inside.

Asserted: no response >= 500, no accepted op that fails with category "server", the server process
still alive, a run of another account made before the fuzz gives the same forward result after, and
a training loop that account runs through the SDK *while* the fuzz runs has the losses, `==`, of the
same loop run undisturbed before it.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import threading
import time
from typing import Any

import httpx
import numpy as np
import pytest
import requests
import schemathesis
import tinker
import zstandard
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode
from tinker import types as t
from tinker.proto import tinker_public_pb2 as pb

from tests.serverproc import API_KEY, start_server

TINY = "tinkerd/tiny-qwen3"
# Wall-clock budgets (s) and example caps per generator: the caps keep a fast machine from
# running long, the budgets a slow or busy one.
BUDGET_S = {"openapi": 20.0, "protobuf": 10.0, "json": 10.0, "futures": 15.0}
MAX_EXAMPLES = {"openapi": 600, "protobuf": 400, "json": 400}

# SDK request types as the bodies of the routes that parse them (tinkerd/api/routes/*).
SDK_BODIES = {
    "/api/v1/create_session": t.CreateSessionRequest,
    "/api/v1/session_heartbeat": t.SessionHeartbeatRequest,
    "/api/v1/get_info": t.GetInfoRequest,
    "/api/v1/create_model": t.CreateModelRequest,
    "/api/v1/optim_step": t.OptimStepRequest,
    "/api/v1/save_weights": t.SaveWeightsRequest,
    "/api/v1/save_weights_for_sampler": t.SaveWeightsForSamplerRequest,
    "/api/v1/load_weights": t.LoadWeightsRequest,
    "/api/v1/create_sampling_session": t.CreateSamplingSessionRequest,
    "/api/v1/asample": t.SampleRequest,
    "/api/v1/retrieve_future": t.FutureRetrieveRequest,
    "/api/v1/save_weights_external": t.SaveWeightsExternalRequest,
    "/api/v1/telemetry": t.TelemetrySendRequest,
}
# Bodies the SDK sends without a pydantic type.
PLAIN_BODIES = {
    ("/api/v1/weights_info", "post"): {"type": "object", "properties": {"tinker_path": {"type": "string"}},
                                       "required": ["tinker_path"]},
    ("/api/v1/training_runs/{run_id}/checkpoints/{type_seg}/{name}/ttl", "put"):
        {"type": "object", "properties": {"ttl_seconds": {"type": ["integer", "null"]}}},
    ("/api/v1/sessions/{session_id}/finish", "post"):
        {"type": "object", "properties": {"reason": {"type": "object", "properties": {
            "type": {"enum": ["success", "errored", "interrupted"]}}}, "detail": {"type": ["string", "null"]}}},
}


def openapi_with_bodies(schema: dict) -> dict:
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    for path, model in SDK_BODIES.items():
        body = model.model_json_schema(ref_template="#/components/schemas/{model}")
        components.update(body.pop("$defs", {}))
        components[model.__name__] = body
        schema["paths"][path]["post"]["requestBody"] = {
            "required": True, "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}
    for (path, method), body in PLAIN_BODIES.items():
        schema["paths"][path][method]["requestBody"] = {"required": True, "content": {"application/json": {"schema": body}}}
    return schema


class Tally:
    """Every request sent by the fuzz and what came back."""

    def __init__(self) -> None:
        self.sent = {"openapi": 0, "protobuf": 0, "json": 0}
        self.server_errors: list[str] = []
        self.accepted: list[str] = []  # request_ids of ops the server queued

    def saw(self, kind: str, what: str, status: int, body: bytes) -> None:
        self.sent[kind] += 1
        if status >= 500:
            self.server_errors.append(f"{status} for {what}: {body[:300]!r}")
        elif status == 200:
            try:
                rid = json.loads(body).get("request_id")
            except (ValueError, AttributeError):
                rid = None
            if isinstance(rid, str):
                self.accepted.append(rid)


class OutOfTime(Exception):
    """Raised by an example once the budget is spent: hypothesis stops generating at once (no
    shrinking phase), and the runner below takes it as the end of the run."""


def _hyp_settings(kind: str):
    # derandomize: the same inputs on every run, so a failure in CI reproduces locally.
    return settings(max_examples=MAX_EXAMPLES[kind], deadline=None, database=None, derandomize=True,
                    phases=[Phase.generate], suppress_health_check=list(HealthCheck), report_multiple_bugs=False)


def _datum(tokens: list[int]) -> t.Datum:
    return t.Datum(model_input=t.ModelInput.from_ints(tokens), loss_fn_inputs={"target_tokens": tokens[1:] + [tokens[0]]})


# The other account's training loop during the fuzz: LOOP_STEPS steps spread over the generators'
# budgets, so that it runs while each of them does (~0.2 s of compute a step on the tiny model).
LOOP_STEPS = 12
LOOP_DATA = [[_datum([(7 * i + 3 * j) % 900 + 1 for j in range(6 + i % 5)])] for i in range(LOOP_STEPS)]


def _loop_client(sc: tinker.ServiceClient):
    return sc.create_lora_training_client(base_model=TINY, rank=4, seed=23).result()


def _loop_step(tc, i: int) -> float:
    fb = tc.forward_backward(LOOP_DATA[i], "cross_entropy")
    tc.optim_step(t.AdamParams(learning_rate=1e-2)).result()
    return fb.result().metrics["loss:sum"]


class ConcurrentLoop:
    """The SDK loop on a thread, one step every `interval_s`, until LOOP_STEPS or `stop()`."""

    def __init__(self, sc: tinker.ServiceClient, interval_s: float):
        self.tc = _loop_client(sc)
        self.interval_s = interval_s
        self.losses: list[float] = []
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="fuzz-concurrent-loop", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            for i in range(LOOP_STEPS):
                if self._stop.wait(self.interval_s if i else 0.0):
                    return
                self.losses.append(_loop_step(self.tc, i))
        except BaseException as e:  # raised by the test that checks it
            self.error = e

    def stop(self) -> list[float]:
        self._stop.set()
        self._thread.join(timeout=120)
        if self.error is not None:
            raise self.error
        return self.losses


@pytest.fixture(scope="module")
def fuzz_env(tmp_path_factory):
    data_dir = tmp_path_factory.mktemp("fuzz-data")
    srv = start_server(data_dir, [TINY], ["--threads", "1", "--retrieve-future-timeout-s", "0.5"])
    try:
        # The victim: another account's run, trained a little before the fuzz starts.
        sc = tinker.ServiceClient(base_url=srv.url, api_key=API_KEY)
        victim = sc.create_lora_training_client(base_model=TINY, rank=4)
        victim = victim.result()
        probe = [_datum([5, 6, 7, 8, 9, 10])]
        for _ in range(2):
            victim.forward_backward(probe, "cross_entropy").result()
            victim.optim_step(t.AdamParams(learning_rate=1e-2)).result()
        before = victim.forward(probe, "cross_entropy").result()
        # The loop undisturbed, then the same loop started again to run alongside the fuzz.
        reference = _loop_client(sc)
        undisturbed = [_loop_step(reference, i) for i in range(LOOP_STEPS)]
        # Spread over half the fuzz's budget: the generators often stop at their example caps well
        # before it (CI once ran 5 steps of 12 at the full budget's pace, and the check below wants 3).
        fuzz_s = BUDGET_S["openapi"] + BUDGET_S["protobuf"] + BUDGET_S["json"]
        loop = ConcurrentLoop(sc, interval_s=fuzz_s / (2 * LOOP_STEPS))
        # The fuzzing account and ids of its own to aim at.
        out = subprocess.run([sys.executable, "-m", "tinkerd.cli.main", "keys", "--data-dir", str(data_dir), "create",
                              "--name", "fuzzer", "--account", "fuzzer"], capture_output=True, text=True, check=True)
        key = out.stdout.split("TINKER_API_KEY=")[1].split()[0]
        c = httpx.Client(base_url=f"{srv.url}/api/v1", headers={"X-API-Key": key}, timeout=60)
        session = c.post("/create_session", json={"tags": [], "user_metadata": {}, "sdk_version": "0.38.0"}).json()["session_id"]
        created = c.post("/create_model", json={"session_id": session, "model_seq_id": 0, "base_model": TINY,
                                                "lora_config": {"rank": 4}}).json()
        c.post("/retrieve_future", json={"request_id": created["request_id"]})
        sampler = c.post("/create_sampling_session", json={"session_id": session, "sampling_session_seq_id": 0,
                                                           "base_model": TINY}).json()["sampling_session_id"]
        yield dict(srv=srv, key=key, client=c, session=session, run=created["model_id"], sampler=sampler,
                   victim=victim, victim_id=victim.model_id, probe=probe, before=before, tally=Tally(),
                   loop=loop, undisturbed=undisturbed)
        loop.stop()
    finally:
        srv.stop()


def _run_budgeted(kind: str, tally: Tally, test) -> None:
    """Run a @given test until its example cap or its wall-clock budget, whichever comes first."""
    deadline = time.monotonic() + BUDGET_S[kind]
    try:
        test(deadline)
    except OutOfTime:
        pass
    print(f"fuzz {kind}: {tally.sent[kind]} requests")


def test_openapi_schema_fuzz(fuzz_env):
    env, tally = fuzz_env, fuzz_env["tally"]
    url, headers = env["srv"].url, {"X-API-Key": env["key"]}
    raw = requests.get(f"{url}/openapi.json", timeout=30).json()
    schema = schemathesis.openapi.from_dict(openapi_with_bodies(raw))
    strategy = st.one_of(schema.as_strategy(GenerationMode.POSITIVE), schema.as_strategy(GenerationMode.NEGATIVE))
    session = requests.Session()

    def fuzz(deadline: float) -> None:
        @_hyp_settings("openapi")
        @given(case=strategy)
        def one(case) -> None:
            if time.monotonic() > deadline:
                raise OutOfTime
            response = case.call(base_url=url, session=session, headers=headers, timeout=60)
            tally.saw("openapi", f"{case.method} {case.formatted_path} query={case.query} {str(case.body)[:200]}",
                      response.status_code, response.content)

        one()

    _run_budgeted("openapi", tally, fuzz)
    assert tally.sent["openapi"] > 50
    assert not tally.server_errors, "\n".join(tally.server_errors[:20])


# -- protobuf ---------------------------------------------------------------------------------------

_int32_bytes = st.lists(st.integers(-(2**31), 2**31 - 1), max_size=12).map(lambda xs: np.asarray(xs, np.int32).tobytes())
_token_bytes = st.one_of(
    st.lists(st.integers(0, 300), min_size=1, max_size=12).map(lambda xs: np.asarray(xs, np.int32).tobytes()),
    _int32_bytes,
    st.binary(max_size=48),
)
_number_bytes = st.one_of(
    st.lists(st.floats(width=32), max_size=12).map(lambda xs: np.asarray(xs, np.float32).tobytes()),
    st.lists(st.integers(-(2**40), 2**40), max_size=12).map(lambda xs: np.asarray(xs, np.int64).tobytes()),
    st.binary(max_size=48),
)


@st.composite
def _tensor(draw, n: int) -> pb.Tensor:
    msg = pb.Tensor(dtype=draw(st.sampled_from([0, 1, 2, 3, 4, 17])))
    msg.shape.extend(draw(st.one_of(st.just([n]), st.just([n, 2]), st.just([]),
                                    st.lists(st.integers(-3, 2**34) | st.integers(0, 16), max_size=3))))
    if draw(st.booleans()):
        msg.dense = draw(_number_bytes)
    else:
        msg.sparse_csr.values = draw(_number_bytes)
        msg.sparse_csr.crow_indices = draw(_number_bytes)
        msg.sparse_csr.col_indices = draw(_number_bytes)
    return msg


@st.composite
def _forward_backward(draw, model_ids: list[str]) -> bytes:
    msg = pb.ForwardBackwardRequest(model_id=draw(st.sampled_from(model_ids) | st.text(max_size=40)),
                                    seq_id=draw(st.integers(-(2**31), 2**31 - 1)),
                                    forward_only=draw(st.booleans()))
    msg.loss_fn = draw(st.sampled_from(["cross_entropy", "importance_sampling", "ppo", "cispo", "dro", "gspo",
                                        "stable_reinforce", "custom", ""]) | st.text(max_size=20))
    for _ in range(draw(st.integers(0, 3))):
        d = msg.data.add()
        for _ in range(draw(st.integers(0, 2))):
            chunk = d.model_input.add()
            which = draw(st.sampled_from(["encoded_text", "encoded_text", "image", "dmel"]))
            if which == "encoded_text":
                chunk.encoded_text.tokens = draw(_token_bytes)
            elif which == "image":
                chunk.image.data = draw(st.binary(max_size=16))
            else:
                chunk.dmel.dmel = draw(st.binary(max_size=16))
        n = draw(st.integers(0, 12))
        for name in draw(st.lists(st.sampled_from(["target_tokens", "weights", "advantages", "logprobs", "junk"]),
                                  max_size=3, unique=True)):
            d.loss_fn_inputs[name].CopyFrom(draw(_tensor(n)))
    for k, v in draw(st.dictionaries(st.text(max_size=12), st.floats(), max_size=3)).items():
        msg.loss_fn_config[k] = v
    for k, v in draw(st.dictionaries(st.text(max_size=12), st.floats() | st.text(max_size=8), max_size=2)).items():
        if isinstance(v, str):
            msg.loss_fn_config_v2[k].text = v
        else:
            msg.loss_fn_config_v2[k].number = v
    body = msg.SerializeToString()
    mutate = draw(st.sampled_from(["none", "none", "truncate", "flip", "random"]))
    if mutate == "truncate" and body:
        body = body[: draw(st.integers(0, len(body) - 1))]
    elif mutate == "flip" and body:
        i = draw(st.integers(0, len(body) - 1))
        body = body[:i] + bytes([body[i] ^ draw(st.integers(1, 255))]) + body[i + 1:]
    elif mutate == "random":
        body = draw(st.binary(max_size=200))
    return body


def test_protobuf_forward_backward_fuzz(fuzz_env):
    env, tally = fuzz_env, fuzz_env["tally"]
    c = env["client"]
    bodies = _forward_backward([env["run"], env["victim_id"], ""])

    def fuzz(deadline: float) -> None:
        @_hyp_settings("protobuf")
        @given(body=bodies, zstd=st.sampled_from([False, False, False, True]), bad_zstd=st.booleans())
        def one(body: bytes, zstd: bool, bad_zstd: bool) -> None:
            if time.monotonic() > deadline:
                raise OutOfTime
            headers = {"Content-Type": "application/x-protobuf"}
            if zstd:
                headers["Content-Encoding"] = "zstd"
                body = body if bad_zstd else zstandard.ZstdCompressor().compress(body)
            r = c.post("/forward_backward", content=body, headers=headers)
            tally.saw("protobuf", f"forward_backward {body[:120]!r} zstd={zstd}", r.status_code, r.content)

        one()

    _run_budgeted("protobuf", tally, fuzz)
    assert tally.sent["protobuf"] > 50
    assert not tally.server_errors, "\n".join(tally.server_errors[:20])


# -- JSON bodies around real ids --------------------------------------------------------------------

# Values at the edges that once got through: int64 and uint64 limits (SQLite's OverflowError was a
# 500), non-finite and overflowing floats (an optim_step with lr=inf "succeeded" into NaN weights),
# and empty or absurd names (path="" saved weights/step-None).
_edges = st.sampled_from([2**63, 2**63 - 1, -(2**63) - 1, -(2**63), 2**64, -1, 0,
                          math.inf, -math.inf, math.nan, 1e300, 1e39, 0.0,
                          "", "a/b", "..", "x\x00y", "n" * 300])
_json_value = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**63) | st.floats() | st.text(max_size=20) | _edges,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=8,
)


def _valid_bodies(env) -> dict[str, dict[str, Any]]:
    prompt = {"chunks": [{"type": "encoded_text", "tokens": [1, 2, 3]}]}
    return {
        "/create_model": {"session_id": env["session"], "model_seq_id": 7, "base_model": TINY, "lora_config": {"rank": 4}},
        "/optim_step": {"model_id": env["run"], "seq_id": 1, "adam_params": {"learning_rate": 1e-3}},
        "/save_weights": {"model_id": env["run"], "seq_id": 1, "path": "fuzz"},
        "/save_weights_for_sampler": {"model_id": env["run"], "seq_id": 1, "sampling_session_seq_id": 5},
        "/load_weights": {"model_id": env["run"], "seq_id": 1, "path": f"tinker://{env['run']}/weights/fuzz"},
        "/asample": {"sampling_session_id": env["sampler"], "seq_id": 1, "num_samples": 1, "prompt": prompt,
                     "sampling_params": {"max_tokens": 4, "temperature": 1.0}},
        "/create_sampling_session": {"session_id": env["session"], "sampling_session_seq_id": 3, "base_model": TINY},
        "/get_info": {"model_id": env["victim_id"]},
        "/weights_info": {"tinker_path": f"tinker://{env['victim_id']}/weights/none"},
        "/save_weights_external": {"model_id": env["run"], "seq_id": 1, "path": "ext"},
        "/retrieve_future": {"request_id": "req-0"},
    }


@st.composite
def _mutated(draw, bodies: dict[str, dict[str, Any]]) -> tuple[str, Any]:
    path = draw(st.sampled_from(sorted(bodies)))
    body = json.loads(json.dumps(bodies[path]))
    for _ in range(draw(st.integers(1, 3))):
        target = body
        # Walk into a nested object now and then (sampling_params, lora_config, prompt, ...).
        while isinstance(target, dict) and target and draw(st.booleans()):
            inner = target[draw(st.sampled_from(sorted(target)))]
            if not isinstance(inner, dict):
                break
            target = inner
        if not isinstance(target, dict):
            break
        action = draw(st.sampled_from(["set", "set", "drop", "add"]))
        if action == "drop" and target:
            del target[draw(st.sampled_from(sorted(target)))]
        elif action == "add":
            target[draw(st.text(max_size=10))] = draw(_json_value)
        elif target:
            target[draw(st.sampled_from(sorted(target)))] = draw(_json_value)
    if draw(st.integers(0, 19)) == 0:
        body = draw(_json_value)  # not even an object
    return path, body


def test_json_bodies_around_real_ids_fuzz(fuzz_env):
    env, tally = fuzz_env, fuzz_env["tally"]
    c = env["client"]
    cases = _mutated(_valid_bodies(env))

    def fuzz(deadline: float) -> None:
        @_hyp_settings("json")
        @given(case=cases)
        def one(case: tuple[str, Any]) -> None:
            if time.monotonic() > deadline:
                raise OutOfTime
            path, body = case
            try:
                content = json.dumps(body, allow_nan=True).encode()
            except (ValueError, OverflowError):
                content = repr(body).encode()
            r = c.post(path, content=content, headers={"Content-Type": "application/json"})
            tally.saw("json", f"{path} {content[:200]!r}", r.status_code, r.content)

        one()

    _run_budgeted("json", tally, fuzz)
    assert tally.sent["json"] > 50
    assert not tally.server_errors, "\n".join(tally.server_errors[:20])


# -- afterwards -------------------------------------------------------------------------------------

def test_after_the_fuzz_the_server_and_the_other_accounts_run_are_intact(fuzz_env):
    env, tally = fuzz_env, fuzz_env["tally"]
    c = env["client"]
    # Ops the fuzz got accepted ran (or run) in the engine: none may fail as the server's fault.
    deadline = time.monotonic() + BUDGET_S["futures"]
    finished, server_failures, pending = 0, [], 0
    for rid in dict.fromkeys(tally.accepted):
        while True:
            r = c.post("/retrieve_future", json={"request_id": rid})
            assert r.status_code < 500, r.text
            is_json = r.headers.get("content-type", "").startswith("application/json")
            answer = r.json() if is_json else {}
            if answer.get("type") != "try_again":
                finished += 1
                if answer.get("category") == "server":
                    server_failures.append(f"{rid}: {answer}")
                break
            if time.monotonic() > deadline:
                pending += 1
                break
    total = sum(tally.sent.values())
    print(f"fuzz: {total} requests ({tally.sent}); {len(set(tally.accepted))} ops accepted, "
          f"{finished} finished, {pending} still queued at the budget; 5xx: {len(tally.server_errors)}")
    assert not server_failures, "\n".join(server_failures[:20])
    assert not tally.server_errors
    srv = env["srv"]
    assert srv.proc.poll() is None
    assert httpx.get(f"{srv.url}/api/v1/healthz").json() == {"status": "ok"}
    # The victim's run, trained before the fuzz, forwards exactly as it did then.
    after = env["victim"].forward(env["probe"], "cross_entropy").result()
    assert after.loss_fn_outputs[0]["logprobs"].data == env["before"].loss_fn_outputs[0]["logprobs"].data
    assert after.metrics == env["before"].metrics
    # The loop that ran during the fuzz: every step it made equals the undisturbed loop's, bit for bit.
    during = env["loop"].stop()
    print(f"concurrent SDK loop: {len(during)} of {LOOP_STEPS} steps during the fuzz, losses == undisturbed: "
          f"{during == env['undisturbed'][:len(during)]}")
    assert len(during) >= LOOP_STEPS // 4, during  # it did run alongside the generators
    assert during == env["undisturbed"][:len(during)]
