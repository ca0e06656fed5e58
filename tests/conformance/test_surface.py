"""The inventory of SDK 0.38's management surface against tinkerd: every public method of
`tinker.RestClient` and `tinker.AdminClient` (each `*_async` twin too) and every `tinker` CLI command,
found by introspecting the installed SDK, each called with real arguments on one account's real run,
checkpoints and sampler, and its answer checked against what that account did.

A method or command the SDK gains without a case here fails `test_the_inventory_is_complete`; one
that cannot work against tinkerd must be in CANNOT with the reason (docs/compatibility.md has the
table). The CLI runs in-process through click's test runner (the SDK's own `main_cli`), with the
account's key and base URL in the environment, as a user's shell would set them."""

from __future__ import annotations

import asyncio
import inspect
import itertools
import json
import warnings
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone

import click
import httpx
import pytest
import tinker
from click.testing import CliRunner
from tinker import types
from tinker.cli.__main__ import main_cli

from tests.conformance.conftest import TINY
from tests.conformance.test_ownership import _key

ACCOUNT = "surface-acct"
PROJECT = "surface-proj"
RANK = 2
TRAINED = 3  # tokens in the one forward_backward the world's run takes; billing must say exactly this

# What cannot be shown against tinkerd, and why. Nothing else may be missing a case.
CANNOT = {
    "checkpoint push-hf": "its other end is the Hugging Face Hub (HfApi.whoami, create_repo, upload_folder), "
                          "which no offline test reaches; the two tinkerd calls it makes are `checkpoint download` "
                          "and get_weights_info_by_tinker_path, both cased here",
}


def _public_methods(cls) -> list[str]:
    return sorted(n for n, v in inspect.getmembers(cls) if not n.startswith("_") and callable(v))


def _cli_commands() -> list[str]:
    out: list[str] = []

    def walk(group: click.Group, prefix: list[str], ctx: click.Context) -> None:
        for name in group.list_commands(ctx):
            cmd = group.get_command(ctx, name)
            if isinstance(cmd, click.Group):
                walk(cmd, [*prefix, name], click.Context(cmd, parent=ctx))
            else:
                out.append(" ".join([*prefix, name]))

    walk(main_cli, [], click.Context(main_cli))
    return sorted(out)


REST_METHODS = _public_methods(tinker.RestClient)
ADMIN_METHODS = _public_methods(tinker.AdminClient)
CLI_COMMANDS = _cli_commands()


@dataclass
class World:
    """One account's run (one trained step), its checkpoints and sampler; the clients to ask about them."""

    url: str
    key: str
    sc: tinker.ServiceClient
    tc: tinker.TrainingClient
    rest: tinker.RestClient
    admin: tinker.AdminClient
    session_id: str
    run_id: str
    state_path: str  # weights/<name>
    sampler_path: str  # sampler_weights/<name>
    sampler_id: str  # a sampling session made from sampler_path
    external_path: str  # external_weights/<name>
    names: itertools.count = field(default_factory=itertools.count)
    cli_home: object = None  # the running CLI case's HOME (a tmp_path)

    def fresh_checkpoint(self, kind: str = "weights") -> str:
        """A new checkpoint of the run, for the cases that change or delete one."""
        name = f"fresh-{next(self.names)}"
        if kind == "sampler_weights":
            return self.tc.save_weights_for_sampler(name).result().path
        return self.tc.save_state(name).result().path

    def checkpoint(self, path: str) -> types.Checkpoint:
        found = [c for c in self.rest.list_checkpoints(self.run_id).result().checkpoints if c.tinker_path == path]
        assert len(found) == 1, (path, found)
        return found[0]


@pytest.fixture(scope="module")
def world(server) -> World:
    key = _key(server.data_dir, ACCOUNT)
    sc = tinker.ServiceClient(base_url=server.url, api_key=key, project_id=PROJECT, user_metadata={"case": "surface"})
    tc = sc.create_lora_training_client(base_model=TINY, rank=RANK, seed=3).result()
    datum = types.Datum(model_input=types.ModelInput.from_ints([5, 6, 7]), loss_fn_inputs={"target_tokens": [6, 7, 8]})
    tc.forward_backward([datum], "cross_entropy").result()
    tc.optim_step(types.AdamParams(learning_rate=1e-3)).result()
    state_path = tc.save_state("surface-state").result().path
    sampler_path = tc.save_weights_for_sampler("surface-sampler").result().path
    sampler = sc.create_sampling_client(model_path=sampler_path).result()
    sampler.sample(types.ModelInput.from_ints([1, 2]), 1, types.SamplingParams(max_tokens=2)).result()
    external = tc.save_weights_external("surface-external").result().path
    return World(url=server.url, key=key, sc=sc, tc=tc, rest=tinker.RestClient(base_url=server.url, api_key=key),
                 admin=tinker.AdminClient(base_url=server.url, api_key=key), session_id=tc.model_id.split(":")[0],
                 run_id=tc.model_id, state_path=state_path, sampler_path=sampler_path,
                 sampler_id=sampler._sampling_session_id, external_path=external)


class Caller:
    """Calls one method of a client the way its user would: `name(...).result()`, or `await name_async(...)`."""

    def __init__(self, client, asynchronous: bool):
        self.client, self.asynchronous = client, asynchronous

    def __call__(self, name: str, *args, **kwargs):
        with warnings.catch_warnings():  # the deprecated and experimental methods warn; they must still work
            warnings.simplefilter("ignore")
            if self.asynchronous:
                return asyncio.run(getattr(self.client, f"{name}_async")(*args, **kwargs))
            out = getattr(self.client, name)(*args, **kwargs)
            return out.result() if hasattr(out, "result") else out


def _window() -> tuple[datetime, datetime]:
    start = datetime.now(timezone.utc).replace(minute=0, second=0, microsecond=0) - timedelta(hours=1)
    return start, start + timedelta(hours=3)


# --- RestClient / AdminClient cases: (world, call) -> None, asserting what the account did -------------------

def _capabilities(w: World, call: Caller) -> None:
    models = {m.model_name for m in call("get_server_capabilities").supported_models}
    assert TINY in models


def _training_run(w: World, call: Caller) -> None:
    run = call("get_training_run", w.run_id)
    assert (run.training_run_id, run.base_model, run.is_lora, run.lora_rank) == (w.run_id, TINY, True, RANK)
    assert call("get_training_run", w.run_id, access_scope="accessible").training_run_id == w.run_id


def _training_run_by_path(w: World, call: Caller) -> None:
    run = call("get_training_run_by_tinker_path", w.state_path)
    assert run.training_run_id == w.run_id and run.base_model == TINY


def _weights_info(w: World, call: Caller) -> None:
    info = call("get_weights_info_by_tinker_path", w.state_path)
    assert (info.base_model, info.is_lora, info.lora_rank) == (TINY, True, RANK)


def _list_training_runs(w: World, call: Caller) -> None:
    assert w.run_id in [r.training_run_id for r in call("list_training_runs", limit=100).training_runs]
    in_project = call("list_training_runs", limit=100, project_id=PROJECT).training_runs
    assert [r.training_run_id for r in in_project] == [w.run_id]


def _list_checkpoints(w: World, call: Caller) -> None:
    listed = {c.tinker_path: c for c in call("list_checkpoints", w.run_id).checkpoints}
    assert listed[w.state_path].checkpoint_type == "training"
    assert listed[w.sampler_path].checkpoint_type == "sampler" and listed[w.sampler_path].size_bytes > 0


def _list_user_checkpoints(w: World, call: Caller) -> None:
    paths = {c.tinker_path for c in call("list_user_checkpoints", limit=1000).checkpoints}
    assert {w.state_path, w.sampler_path} <= paths


def _external_urls(w: World, call: Caller) -> None:
    urls = call("get_external_weights_urls", w.external_path).urls
    assert "adapter_model.safetensors" in urls
    body = httpx.get(urls["adapter_model.safetensors"]).raise_for_status().content
    assert body[8:9] == b"{"  # a safetensors header: 8 length bytes, then its JSON


def _delete_checkpoint(w: World, call: Caller) -> None:
    path = w.fresh_checkpoint()
    call("delete_checkpoint", w.run_id, path.split("/", 3)[3])
    assert path not in {c.tinker_path for c in w.rest.list_checkpoints(w.run_id).result().checkpoints}


def _delete_by_path(w: World, call: Caller) -> None:
    path = w.fresh_checkpoint("sampler_weights")
    call("delete_checkpoint_from_tinker_path", path)
    assert path not in {c.tinker_path for c in w.rest.list_checkpoints(w.run_id).result().checkpoints}


def _publish(w: World, call: Caller) -> None:
    path = w.fresh_checkpoint("sampler_weights")
    call("publish_checkpoint_from_tinker_path", path)
    assert w.checkpoint(path).public is True


def _unpublish(w: World, call: Caller) -> None:
    path = w.fresh_checkpoint("sampler_weights")
    w.rest.publish_checkpoint_from_tinker_path(path).result()
    call("unpublish_checkpoint_from_tinker_path", path)
    assert w.checkpoint(path).public is False


def _set_ttl(w: World, call: Caller) -> None:
    path = w.fresh_checkpoint()
    before = datetime.now(timezone.utc)
    call("set_checkpoint_ttl_from_tinker_path", path, 7200)
    expires = w.checkpoint(path).expires_at
    assert expires is not None and timedelta(hours=2) - timedelta(minutes=5) < expires - before <= timedelta(hours=2, minutes=1)
    call("set_checkpoint_ttl_from_tinker_path", path, None)
    assert w.checkpoint(path).expires_at is None


def _copy_weights(w: World, call: Caller) -> None:
    copied = call("copy_weights", w.sampler_path, f"{PROJECT}-copies")
    assert copied != w.sampler_path and copied.startswith("tinker://")
    assert w.rest.get_weights_info_by_tinker_path(copied).result().base_model == TINY
    assert copied in {c.tinker_path for c in w.rest.list_user_checkpoints(limit=1000).result().checkpoints}


def _audit_log(w: World, call: Caller) -> None:
    path = w.fresh_checkpoint("sampler_weights")
    w.rest.publish_checkpoint_from_tinker_path(path).result()
    log = call("get_audit_log")
    assert "api_key_created" in [e.event for e in log.entries]
    assert [e.tinker_path for e in log.entries if e.event == "checkpoint_published"][-1] == path
    day = call("get_audit_log", "checkpoints", datetime.now(timezone.utc).date()).entries
    assert day and all(e.event.startswith("checkpoint_") for e in day)


def _billing_usage(w: World, call: Caller) -> None:
    start, end = _window()
    usage = call("get_billing_usage", start, end)
    kinds = {"training", "sampling_prefill", "sampling_sample"}
    tokens = [e for e in usage.data if e.event_info.type in kinds]
    assert sum(e.event_info.token_count for e in tokens if e.event_info.type == "training") == TRAINED
    assert {e.event_info.type for e in tokens} == kinds
    assert {(e.session_id, e.project_id) for e in tokens} == {(w.session_id, PROJECT)}
    # Checkpoint storage is billed per account (no session): the world's checkpoints are stored now.
    assert sum(e.event_info.gigabyte_hours for e in usage.data if e.event_info.type == "storage") > 0


def _storage_usage(w: World, call: Caller) -> None:
    item = call("get_current_checkpoint_storage_usage", PROJECT).data
    assert len(item) == 1 and item[0].project_id == PROJECT and item[0].checkpoint_count >= 3
    assert item[0].size_bytes >= w.checkpoint(w.sampler_path).size_bytes


def _get_session(w: World, call: Caller) -> None:
    got = call("get_session", w.session_id)
    assert got.training_run_ids == [w.run_id] and w.sampler_id in got.sampler_ids
    assert got.user_metadata == {"case": "surface"}


def _list_sessions(w: World, call: Caller) -> None:
    assert w.session_id in call("list_sessions", limit=1000).sessions


def _search_sessions(w: World, call: Caller) -> None:
    found = call("search_sessions", types.SessionSearchRequest(user_metadata={"case": "surface"})).sessions
    assert [s.session_id for s in found] == [w.session_id] and found[0].checkpoints_count >= 3


def _assign_project(w: World, call: Caller) -> None:
    other = tinker.ServiceClient(base_url=w.url, api_key=w.key, project_id=f"{PROJECT}-from")
    sid = other.holder.get_session_id()
    target = f"{PROJECT}-to-{next(w.names)}"
    call("assign_session_project", sid, target)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        found = w.rest.search_sessions(types.SessionSearchRequest(session_id=sid)).result().sessions
    assert [s.project_id for s in found] == [target]


def _export_trace(w: World, call: Caller) -> None:
    url = call("export_session_trace", w.session_id)
    trace = httpx.get(url).raise_for_status().json()
    names = {e.get("name") for e in trace["traceEvents"]}
    assert {"ForwardBackward", "OptimStep"} <= names, names


def _whoami(w: World, call: Caller) -> None:
    me = call("whoami")
    assert me.email == ACCOUNT and me.user_urn.startswith("tml:user:acct-")


def _get_sampler(w: World, call: Caller) -> None:
    got = call("get_sampler", w.sampler_id)
    assert (got.sampler_id, got.base_model, got.model_path) == (w.sampler_id, TINY, w.sampler_path)


def _telemetry(w: World, call: Caller) -> None:
    telemetry = call("get_telemetry")
    assert isinstance(telemetry, tinker.lib.telemetry.Telemetry)
    assert telemetry.log("surface_inventory", {"n": 1})
    # Its batches reach the server's telemetry endpoint and are accepted (the SDK drops failed batches
    # with only a warning, so send one through its own sender and read the answer).
    batch = telemetry._batch([telemetry._generic_event("surface_inventory", {"n": 2}, "INFO")])
    loop = telemetry._tinker_provider.get_loop()
    assert asyncio.run_coroutine_threadsafe(telemetry._send_batch(batch), loop).result(timeout=60).status == "accepted"


CASES = {
    "get_server_capabilities": _capabilities, "get_training_run": _training_run,
    "get_training_run_by_tinker_path": _training_run_by_path, "get_weights_info_by_tinker_path": _weights_info,
    "list_training_runs": _list_training_runs, "list_checkpoints": _list_checkpoints,
    "list_user_checkpoints": _list_user_checkpoints, "get_external_weights_urls": _external_urls,
    "delete_checkpoint": _delete_checkpoint, "delete_checkpoint_from_tinker_path": _delete_by_path,
    "publish_checkpoint_from_tinker_path": _publish, "unpublish_checkpoint_from_tinker_path": _unpublish,
    "set_checkpoint_ttl_from_tinker_path": _set_ttl, "copy_weights": _copy_weights, "get_audit_log": _audit_log,
    "get_billing_usage": _billing_usage, "get_current_checkpoint_storage_usage": _storage_usage,
    "get_session": _get_session, "list_sessions": _list_sessions, "search_sessions": _search_sessions,
    "assign_session_project": _assign_project, "export_session_trace": _export_trace, "whoami": _whoami,
    "get_sampler": _get_sampler, "get_telemetry": _telemetry,
}


def _case_ids() -> list[tuple[str, str]]:
    return [("RestClient", m) for m in REST_METHODS] + [("AdminClient", m) for m in ADMIN_METHODS]


@pytest.mark.parametrize("client_name, method", _case_ids(), ids=[f"{c}.{m}" for c, m in _case_ids()])
def test_method(world, client_name, method):
    base = method.removesuffix("_async")
    assert base in CASES, f"{client_name}.{method} has no case"
    client = world.rest if client_name == "RestClient" else world.admin
    CASES[base](world, Caller(client, asynchronous=method.endswith("_async")))


# --- Bad input: every method that takes an argument, given a wrong one, answers the 4xx that names it --------

MISSING_RUN = "sess-0000000000000000:train:0"
BAD_INPUT = {  # method: (status, args, what the message must name)
    "get_training_run": (404, (MISSING_RUN,), MISSING_RUN),
    "get_training_run_by_tinker_path": (404, (f"tinker://{MISSING_RUN}/weights/x",), MISSING_RUN),
    "get_weights_info_by_tinker_path": (404, (f"tinker://{MISSING_RUN}/weights/x",), MISSING_RUN),
    "list_training_runs": (404, ((), {"project_id": "no-such-project"}), "no-such-project"),
    "list_checkpoints": (404, (MISSING_RUN,), MISSING_RUN),
    "list_user_checkpoints": (400, ((), {"limit": -1}), "limit"),
    "get_external_weights_urls": (404, ("{run}/external_weights/missing",), "missing"),
    "delete_checkpoint": (404, ("{run_id}", "weights/missing"), "missing"),
    "delete_checkpoint_from_tinker_path": (404, ("{run}/weights/missing",), "missing"),
    "publish_checkpoint_from_tinker_path": (404, ("{run}/sampler_weights/missing",), "missing"),
    "unpublish_checkpoint_from_tinker_path": (404, ("{run}/sampler_weights/missing",), "missing"),
    "set_checkpoint_ttl_from_tinker_path": (400, ("{state}", -5), "ttl"),
    "copy_weights": (404, (f"tinker://{MISSING_RUN}/sampler_weights/x", "p"), MISSING_RUN),
    "get_audit_log": (400, ("bogus",), "event_type"),
    "get_billing_usage": (400, ("2026-01-01T00:30:00Z", "2026-01-01T02:00:00Z"), "hour"),
    "get_current_checkpoint_storage_usage": (404, ("no-such-project",), "no-such-project"),
    "get_session": (404, ("sess-0000000000000000",), "sess-0000000000000000"),
    "list_sessions": (400, ((), {"access_scope": "everyone"}), "access_scope"),
    "search_sessions": (404, (types.SessionSearchRequest(project_ids=["no-such-project"]),), "no-such-project"),
    "assign_session_project": (400, ("{session}", "not a name!"), "project"),
    "export_session_trace": (404, ("sess-0000000000000000",), "sess-0000000000000000"),
    "get_sampler": (404, ("sess-0000000000000000:sample:0",), "sess-0000000000000000"),
}
NO_ARGUMENTS = {"get_server_capabilities", "whoami", "get_telemetry"}


def _fill(w: World, value):
    if not isinstance(value, str):
        return value
    return value.format(run=f"tinker://{w.run_id}", run_id=w.run_id, state=w.state_path, session=w.session_id)


@pytest.mark.parametrize("method", sorted(BAD_INPUT))
def test_bad_input(world, method):
    status, args, named = BAD_INPUT[method]
    args, kwargs = (args if len(args) == 2 and isinstance(args[1], dict) and args[0] == () else (args, {}))
    client = world.admin if method in ADMIN_METHODS else world.rest
    with pytest.raises(tinker.APIStatusError) as err:
        Caller(client, asynchronous=False)(method, *[_fill(world, a) for a in args], **kwargs)
    assert err.value.status_code == status and named in str(err.value), (err.value.status_code, str(err.value))
    assert err.value.body.get("category") == "user", err.value.body


# --- CLI cases: (world, run) -> None, run(*args) -> parsed JSON or text --------------------------------------

def _run_cli(w: World, home, *args: str, stdin: str | None = None, json_out: bool = True):
    env = {"TINKER_BASE_URL": w.url, "TINKER_API_KEY": w.key, "HOME": str(home), "COLUMNS": "400",
           "TINKER_PROJECT_ID": None}
    result = CliRunner().invoke(main_cli, [*(["--format", "json"] if json_out else []), *args], input=stdin, env=env,
                                catch_exceptions=False)
    assert result.exit_code == 0, (args, result.output)
    return json.loads(result.stdout) if json_out else result.stdout


def _cli_login(w, run):
    assert f"Logged in as {ACCOUNT}" in run("auth", "login", stdin=w.key + "\n", json_out=False)


def _cli_logout(w, run):
    run("auth", "login", stdin=w.key + "\n", json_out=False)
    assert "still active" in run("auth", "logout", json_out=False)
    assert httpx.get(f"{w.url}/api/v1/auth/apikey/me", headers={"X-API-Key": w.key}).status_code == 200


def _cli_status(w, run):
    assert "Tinker accessible: yes" in run("auth", "status", json_out=False)


def _cli_whoami(w, run):
    assert run("auth", "whoami")["email"] == ACCOUNT


def _cli_storage(w, run):
    out = run("billing", "checkpoint-storage", "--project-id", PROJECT)
    assert [d["project_id"] for d in out["data"]] == [PROJECT] and out["data"][0]["checkpoint_count"] >= 3


def _cli_usage(w, run):
    start, end = (d.strftime("%Y-%m-%dT%H:%M:%SZ") for d in _window())
    out = run("billing", "usage", start, end)
    assert sum(e["event_info"]["token_count"] for e in out["data"] if e["event_info"]["type"] == "training") == TRAINED


def _cli_delete(w, run):
    path = w.fresh_checkpoint()
    run("checkpoint", "delete", path, "--yes", json_out=False)
    assert path not in {c.tinker_path for c in w.rest.list_checkpoints(w.run_id).result().checkpoints}


def _cli_download(w, run):
    # (The SDK's CLI itself refuses sampler checkpoints: "Sampler checkpoints cannot be downloaded".)
    out = run("checkpoint", "download", w.state_path, "--output", str(w.cli_home / "dl"))
    files = {p.name for p in (w.cli_home / "dl").rglob("*") if p.is_file()}
    assert {"adapter_config.json", "adapter_model.safetensors"} <= files, (out, files)


def _cli_info(w, run):
    out = run("checkpoint", "info", w.state_path)
    assert out["tinker_path"] == w.state_path and out["checkpoint_type"] == "training"


def _cli_list(w, run):
    out = run("checkpoint", "list", "--run-id", w.run_id)
    assert {w.state_path, w.sampler_path} <= {c["tinker_path"] for c in out["checkpoints"]}


def _cli_publish(w, run):
    path = w.fresh_checkpoint("sampler_weights")
    run("checkpoint", "publish", path, json_out=False)
    assert w.checkpoint(path).public is True


def _cli_unpublish(w, run):
    path = w.fresh_checkpoint("sampler_weights")
    w.rest.publish_checkpoint_from_tinker_path(path).result()
    run("checkpoint", "unpublish", path, json_out=False)
    assert w.checkpoint(path).public is False


def _cli_set_ttl(w, run):
    path = w.fresh_checkpoint()
    run("checkpoint", "set-ttl", path, "--ttl", "7200", json_out=False)
    assert w.checkpoint(path).expires_at is not None
    run("checkpoint", "set-ttl", path, "--remove", json_out=False)
    assert w.checkpoint(path).expires_at is None


def _cli_models(w, run):
    out = run("model", "list", "tiny")
    assert TINY in json.dumps(out)


def _cli_run_info(w, run):
    out = run("run", "info", w.run_id)
    assert out["training_run_id"] == w.run_id and out["base_model"] == TINY


def _cli_run_list(w, run):
    out = run("run", "list", "--limit", "1000")
    assert w.run_id in {r["training_run_id"] for r in out["runs"]}


def _cli_export_trace(w, run):
    target = w.cli_home / "trace.json"
    run("session", "export-trace", w.session_id, "--output", str(target), json_out=False)
    assert "ForwardBackward" in {e.get("name") for e in json.loads(target.read_text())["traceEvents"]}


def _cli_version(w, run):
    assert tinker.__version__ in run("version", json_out=False)


CLI_CASES = {
    "auth login": _cli_login, "auth logout": _cli_logout, "auth status": _cli_status, "auth whoami": _cli_whoami,
    "billing checkpoint-storage": _cli_storage, "billing usage": _cli_usage, "checkpoint delete": _cli_delete,
    "checkpoint download": _cli_download, "checkpoint info": _cli_info, "checkpoint list": _cli_list,
    "checkpoint publish": _cli_publish, "checkpoint unpublish": _cli_unpublish, "checkpoint set-ttl": _cli_set_ttl,
    "model list": _cli_models, "run info": _cli_run_info, "run list": _cli_run_list,
    "session export-trace": _cli_export_trace, "version": _cli_version,
}


@pytest.mark.parametrize("command", [c for c in CLI_COMMANDS if c not in CANNOT])
def test_cli_command(world, command, tmp_path):
    assert command in CLI_CASES, f"`tinker {command}` has no case"
    world.cli_home = tmp_path
    CLI_CASES[command](world, lambda *a, **k: _run_cli(world, tmp_path, *a, **k))


def test_the_inventory_is_complete():
    """Every method and command of the installed SDK has a case or a reason, and none is stale."""
    methods = {m.removesuffix("_async") for m in REST_METHODS + ADMIN_METHODS}
    assert methods == set(CASES), methods ^ set(CASES)
    assert set(CLI_COMMANDS) == set(CLI_CASES) | set(CANNOT), set(CLI_COMMANDS) ^ (set(CLI_CASES) | set(CANNOT))
    assert methods == set(BAD_INPUT) | NO_ARGUMENTS, methods ^ (set(BAD_INPUT) | NO_ARGUMENTS)
    assert len(REST_METHODS) >= 45 and len(ADMIN_METHODS) >= 7 and len(CLI_COMMANDS) >= 19  # the 0.38 surface
