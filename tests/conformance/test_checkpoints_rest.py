"""Checkpoints through the unmodified SDK: resume, the RestClient surface, TTL expiry, exports with
signed download URLs, the `tinker checkpoint` CLI, and bad input that must hurt nothing."""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from datetime import datetime, timedelta, timezone
from pathlib import Path

import httpx
import pyrage
import pytest
import tinker
from tinker import types

from tests.conformance.conftest import TINY
from tests.conformance.test_ownership import _key
from tests.serverproc import API_KEY

HEADERS = {"X-API-Key": API_KEY}
TOKENS = list(range(1000, 1024))


def _data() -> list[types.Datum]:
    return [
        types.Datum(model_input=types.ModelInput.from_ints(TOKENS[:-1]),
                    loss_fn_inputs={"target_tokens": TOKENS[1:], "weights": [1.0] * (len(TOKENS) - 1)})
    ]


def _train(tc, steps: int) -> list[float]:
    futures = []
    for _ in range(steps):
        futures.append(tc.forward_backward(_data(), "cross_entropy"))
        tc.optim_step(types.AdamParams(learning_rate=2e-2))
    return [f.result().metrics["loss:sum"] for f in futures]


def _ckpt_dir(server, path: str) -> Path:
    run, segment, name = path[len("tinker://"):].split("/")
    return server.data_dir / "checkpoints" / run / segment / name


@pytest.fixture
def rest(server) -> tinker.RestClient:
    return tinker.RestClient(base_url=server.url, api_key=API_KEY)


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_legacy_load_state_with_optimizer_reproduces_the_next_steps_exactly(service_client):
    # (create_training_client_from_state_with_optimizer is covered in test_sdk_training.py.)
    tc = service_client.create_lora_training_client(base_model=TINY, rank=4, seed=7).result()
    _train(tc, 2)
    path = tc.save_state("k2").result().path
    uninterrupted = _train(tc, 3)
    tc.load_state_with_optimizer(path).result()
    assert _train(tc, 3) == uninterrupted


def test_runs_and_checkpoints_through_the_rest_client(store_server):
    server = store_server  # on SQLite and on PostgreSQL
    service_client = tinker.ServiceClient(base_url=server.url, api_key=API_KEY)
    rest = tinker.RestClient(base_url=server.url, api_key=API_KEY)
    meta = {"renderer_name": "qwen3_instruct", "recipe": "rest-test"}
    older = service_client.create_lora_training_client(base_model=TINY, rank=2).result()
    tc = service_client.create_lora_training_client(base_model=TINY, rank=4, seed=1, train_mlp=False,
                                                    user_metadata=meta).result()
    _train(tc, 1)
    a = tc.save_state("a", ttl_seconds=7200, user_metadata={"step": "1"}).result().path
    s = tc.save_weights_for_sampler("s").result().path
    b = tc.save_state("b").result().path
    mid = tc.model_id

    run = rest.get_training_run(mid).result()
    assert (run.training_run_id, run.base_model, run.is_lora, run.lora_rank, run.corrupted) == (mid, TINY, True, 4, False)
    assert run.user_metadata == meta and run.model_owner
    assert run.last_checkpoint.tinker_path == b and run.last_sampler_checkpoint.tinker_path == s
    assert abs(datetime.now(timezone.utc) - run.last_request_time) < timedelta(minutes=5)
    assert rest.get_training_run_by_tinker_path(a).result() == run

    listed = rest.list_training_runs(limit=1000).result()
    assert mid in [r.training_run_id for r in listed.training_runs]
    total = listed.cursor.total_count
    assert total == len(listed.training_runs) and listed.cursor.offset == 0
    first, second = (rest.list_training_runs(limit=1, offset=i).result() for i in (0, 1))
    assert first.training_runs[0].training_run_id == mid  # newest first
    assert second.training_runs[0].training_run_id == older.model_id and second.cursor.total_count == total

    ckpts = rest.list_checkpoints(mid).result().checkpoints
    assert [(c.checkpoint_id, c.checkpoint_type) for c in ckpts] == [
        ("weights/b", "training"), ("sampler_weights/s", "sampler"), ("weights/a", "training")]
    by_id = {c.checkpoint_id: c for c in ckpts}
    assert by_id["weights/a"].user_metadata == {"step": "1"}
    assert timedelta(seconds=7100) < by_id["weights/a"].expires_at - datetime.now(timezone.utc) <= timedelta(seconds=7200)
    assert by_id["weights/b"].expires_at is None and not any(c.public for c in ckpts)
    for c in ckpts:
        assert c.size_bytes == sum(f.stat().st_size for f in _ckpt_dir(server, c.tinker_path).iterdir())
    mine = rest.list_user_checkpoints(limit=2).result()
    assert [c.tinker_path for c in mine.checkpoints] == [b, s]
    assert mine.cursor.total_count >= 3 and mine.cursor.limit == 2
    assert rest.list_user_checkpoints(limit=1, offset=2).result().checkpoints[0].tinker_path == a

    info = rest.get_weights_info_by_tinker_path(s).result()
    assert (info.base_model, info.is_lora, info.lora_rank) == (TINY, True, 4)
    assert (info.train_attn, info.train_mlp, info.train_unembed) == (True, False, True)

    rest.publish_checkpoint_from_tinker_path(a).result()
    assert {c.checkpoint_id: c.public for c in rest.list_checkpoints(mid).result().checkpoints}["weights/a"]
    rest.unpublish_checkpoint_from_tinker_path(a).result()
    assert not any(c.public for c in rest.list_checkpoints(mid).result().checkpoints)
    rest.set_checkpoint_ttl_from_tinker_path(b, 86400).result()
    rest.set_checkpoint_ttl_from_tinker_path(a, None).result()
    ttl = {c.checkpoint_id: c.expires_at for c in rest.list_checkpoints(mid).result().checkpoints}
    assert ttl["weights/a"] is None and ttl["weights/b"] > datetime.now(timezone.utc) + timedelta(hours=23)

    rest.delete_checkpoint_from_tinker_path(b).result()
    assert not _ckpt_dir(server, b).exists()
    assert [c.checkpoint_id for c in rest.list_checkpoints(mid).result().checkpoints] == ["sampler_weights/s", "weights/a"]
    assert rest.get_training_run(mid).result().last_checkpoint.tinker_path == a
    with pytest.raises(tinker.NotFoundError):
        rest.delete_checkpoint_from_tinker_path(b).result()
    with pytest.raises(tinker.NotFoundError):
        service_client.create_training_client_from_state(b).result()


def test_a_save_that_fails_on_disk_registers_nothing(service_client, rest, server):
    tc = service_client.create_lora_training_client(base_model=TINY, rank=2, seed=1).result()
    # A file where the run's weights/ directory must go: the engine's write fails.
    blocker = server.data_dir / "checkpoints" / tc.model_id / "weights"
    blocker.parent.mkdir(parents=True)
    blocker.write_text("in the way")
    with pytest.raises(tinker.RequestFailedError):
        tc.save_state("x").result()
    assert rest.list_checkpoints(tc.model_id).result().checkpoints == []
    assert rest.get_training_run(tc.model_id).result().last_checkpoint is None
    blocker.unlink()
    path = tc.save_state("x").result().path
    assert [c.tinker_path for c in rest.list_checkpoints(tc.model_id).result().checkpoints] == [path]


def test_an_absurd_ttl_is_a_user_error_before_anything_is_written(service_client, rest, server):
    """One TTL validation for every save, before the op is queued: 10**12 s (31,700 years) once wrote
    the files and then failed as a server error, leaving the directory behind."""
    tc = service_client.create_lora_training_client(base_model=TINY, rank=2, seed=1).result()
    run_dir = server.data_dir / "checkpoints" / tc.model_id
    for save in (lambda: tc.save_state("forever", ttl_seconds=10**12),
                 lambda: tc.save_weights_for_sampler("forever", ttl_seconds=10**12),
                 lambda: tc.save_state("never", ttl_seconds=0)):
        with pytest.raises(tinker.BadRequestError) as info:
            save().result()
        assert "ttl_seconds must be between 1 and" in str(info.value)
    assert rest.list_checkpoints(tc.model_id).result().checkpoints == []
    assert not run_dir.exists() or not any(run_dir.rglob("*")), list(run_dir.rglob("*"))
    # The run goes on: the longest allowed TTL saves.
    path = tc.save_state("ten-years", ttl_seconds=10 * 365 * 24 * 3600).result().path
    assert [c.tinker_path for c in rest.list_checkpoints(tc.model_id).result().checkpoints] == [path]


def _fetch(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=30) as r:  # plain urllib, no API key: the URL is the credential
        return r.read()


def _forbidden(url: str) -> str:
    with pytest.raises(urllib.error.HTTPError) as info:
        _fetch(url)
    assert info.value.code == 403
    return json.loads(info.value.read())["error"]


def test_external_weights_export_and_signed_urls(service_client, rest, server):
    tc = service_client.create_lora_training_client(base_model=TINY, rank=4, seed=2).result()
    _train(tc, 1)
    path = tc.save_weights_external("e1", ttl_seconds=7200).result().path
    assert path == f"tinker://{tc.model_id}/external_weights/e1"
    (ext,) = rest.list_checkpoints(tc.model_id).result().checkpoints
    assert ext.checkpoint_type == "external" and ext.checkpoint_id == "external_weights/e1" and ext.expires_at

    signed = rest.get_external_weights_urls(path).result()
    assert sorted(signed.urls) == ["adapter_config.json", "adapter_model.safetensors"]
    assert timedelta(minutes=55) < signed.expires - datetime.now(timezone.utc) <= timedelta(hours=1)
    files = {name: _fetch(url) for name, url in signed.urls.items()}
    assert sum(map(len, files.values())) == ext.size_bytes
    cfg = json.loads(files["adapter_config.json"])
    assert cfg["r"] == 4 and cfg["lora_alpha"] == 32.0
    for name, data in files.items():
        assert (_ckpt_dir(server, path) / name).read_bytes() == data

    url = signed.urls["adapter_model.safetensors"]
    assert "signature" in _forbidden(url[:-1] + ("0" if url[-1] != "0" else "1"))
    assert "signature" in _forbidden(url.replace("adapter_model.safetensors", "adapter_config.json", 1))
    assert "not signed" in _forbidden(url.split("?")[0])
    key = (server.data_dir / "url_signing.key").read_bytes()
    past = int(time.time()) - 10
    sig = hmac.new(key, f"{tc.model_id}\ne1\nadapter_model.safetensors\n{past}".encode(), hashlib.sha256).hexdigest()
    assert "expired" in _forbidden(f"{url.split('?')[0]}?expires={past}&sig={sig}")

    # URLs point at the host the client used, whatever that was.
    r = httpx.get(f"{server.url}/api/v1/training_runs/{tc.model_id}/checkpoints/external_weights/e1/external_weights_urls",
                  headers={**HEADERS, "Host": "tinkerd.example:8443"})
    assert r.status_code == 200
    assert all(u.startswith("http://tinkerd.example:8443/files/") for u in r.json()["urls"].values())

    # An encrypted export of the same weights decrypts to the same files.
    identity = pyrage.x25519.Identity.generate()
    enc = tc.save_weights_external("e2", age_encryption_recipients=[str(identity.to_public())]).result().path
    enc_urls = rest.get_external_weights_urls(enc).result().urls
    assert sorted(enc_urls) == ["adapter_config.json.age", "adapter_model.safetensors.age"]
    for name, u in enc_urls.items():
        assert pyrage.decrypt(_fetch(u), [identity]) == files[name.removesuffix(".age")]

    # Deleting the export revokes its URLs.
    rest.delete_checkpoint_from_tinker_path(path).result()
    with pytest.raises(urllib.error.HTTPError) as info:
        _fetch(url)
    assert info.value.code == 404


def _status(method: str, url: str, **kwargs) -> tuple[int, str]:
    r = httpx.request(method, url, headers=HEADERS, **kwargs)
    assert r.headers["content-type"].startswith("application/json"), r.text
    return r.status_code, r.json().get("error", "")


def test_bad_paths_and_values_are_clear_4xx_and_change_nothing(service_client, rest, server):
    tc = service_client.create_lora_training_client(base_model=TINY, rank=2, seed=3).result()
    keep = tc.save_state("keep").result().path
    mid, api = tc.model_id, f"{server.url}/api/v1"
    run_url = f"{api}/training_runs/{mid}"

    assert _status("GET", f"{api}/training_runs/sess-nope:train:0")[0] == 404
    assert _status("GET", f"{api}/training_runs/{mid}/checkpoints".replace(mid, "sess-nope:train:0"))[0] == 404
    code, msg = _status("DELETE", f"{run_url}/checkpoints/weights/a/b")
    assert code == 404 and "no '/'" in msg
    assert _status("DELETE", f"{run_url}/checkpoints/bogus/keep")[0] == 400
    assert _status("DELETE", f"{run_url}/checkpoints/weights/..")[0] == 404  # the client normalises '..' away
    assert _status("DELETE", f"{run_url}/checkpoints/weights/.%2E")[0] in (400, 404)
    with pytest.raises(tinker.APIStatusError):
        rest.delete_checkpoint_from_tinker_path(f"tinker://{mid}/weights/..").result()
    with pytest.raises(tinker.NotFoundError):
        rest.delete_checkpoint_from_tinker_path(f"tinker://sess-foreign:train:0/weights/keep").result()
    for body in ({"ttl_seconds": -5}, {"ttl_seconds": "60"}, {"ttl_seconds": True}, {}, [1]):
        assert _status("PUT", f"{run_url}/checkpoints/weights/keep/ttl", json=body)[0] == 400, body
    assert _status("PUT", f"{run_url}/checkpoints/weights/nope/ttl", json={"ttl_seconds": 60})[0] == 404
    assert _status("POST", f"{api}/weights_info", json={"tinker_path": "s3://bucket/x"})[0] == 400
    assert _status("POST", f"{api}/weights_info", json={"tinker_path": f"tinker://{mid}/weights/a/b"})[0] == 400
    assert _status("POST", f"{api}/weights_info", json={"tinker_path": "tinker://sess-nope:train:0/weights/x"})[0] == 404
    for query in ("access_scope=everyone", "limit=-1", "limit=abc", "offset=-3", "project_id=a/b"):
        assert _status("GET", f"{api}/training_runs?{query}")[0] == 400, query
    assert _status("GET", f"{api}/training_runs?project_id=no-such-project")[0] == 404
    assert _status("GET", f"{api}/checkpoints?limit=100000")[0] == 400

    with pytest.raises(tinker.BadRequestError):
        tc.save_weights_external("../escape").result()
    with pytest.raises(tinker.BadRequestError):
        tc.save_weights_external("x", ttl_seconds=-1).result()
    with pytest.raises(tinker.RequestFailedError) as info:
        tc.save_weights_external("x", age_encryption_recipients=["age1notakey"]).result()
    assert info.value.category == "user" and "recipient" in info.value.message
    tc.save_weights_external("x").result()
    with pytest.raises(tinker.BadRequestError):
        tc.save_weights_external("x").result()
    with pytest.raises(ValueError):  # the SDK itself refuses URLs for non-external checkpoints
        rest.get_external_weights_urls(keep).result()
    assert _status("GET", f"{run_url}/checkpoints/weights/keep/external_weights_urls")[0] == 404

    assert [c.checkpoint_id for c in rest.list_checkpoints(mid).result().checkpoints] == ["external_weights/x", "weights/keep"]
    assert _ckpt_dir(server, keep).is_dir()
    assert sorted(os.listdir(server.data_dir / "checkpoints" / mid)) == ["external_weights", "weights"]
    assert sorted(os.listdir(server.data_dir / "checkpoints" / mid / "external_weights")) == ["x"]


def test_a_resent_save_answers_its_own_future_once_its_name_is_taken(service_client, server):
    """The SDK re-sends a save whose answer a restart cut off (same seq_id): by then the save may have
    run and taken its name. The re-send gets the accepted op's future, not "already exists"; a new
    save (a new seq_id) under a taken name is still refused. (test_chaos shows it across a restart.)"""
    tc = service_client.create_lora_training_client(base_model=TINY, rank=2, seed=3).result()
    api = f"{server.url}/api/v1"
    sends = [(tc.save_weights_external, "save_weights_external", "external_weights"),
             (tc.save_state, "save_weights", "weights")]
    for save, route, kind in sends:
        path = save("again").result().path
        body = {"model_id": tc.model_id, "path": "again", "seq_id": tc._request_id_counter, "type": route}
        r = httpx.post(f"{api}/{route}", json=body, headers=HEADERS)
        assert r.status_code == 200, r.text
        done = httpx.post(f"{api}/retrieve_future", json={"request_id": r.json()["request_id"]}, headers=HEADERS)
        assert done.status_code == 200 and done.json()["path"] == path == f"tinker://{tc.model_id}/{kind}/again", done.text
        with pytest.raises(tinker.BadRequestError, match="already exist"):
            save("again").result()


def test_expired_checkpoints_leave_listings_and_disk(timers_server):
    # On the shared timers server (conftest.py), whose sweeper runs every 0.2 s instead of every
    # minute; an account of its own, so the user's listing holds only this test's checkpoints.
    srv = timers_server
    key = _key(srv.data_dir, "erin-expiry")
    sc = tinker.ServiceClient(base_url=srv.url, api_key=key)
    rest = tinker.RestClient(base_url=srv.url, api_key=key)
    tc = sc.create_lora_training_client(base_model=TINY, rank=2, seed=1).result()
    keep = tc.save_state("keep", ttl_seconds=3600).result().path
    gone = tc.save_state("gone").result().path
    gone_s = tc.save_weights_for_sampler("gone-s").result().path
    for p in (gone, gone_s):
        rest.set_checkpoint_ttl_from_tinker_path(p, 1).result()  # the SDK has no 3600 s floor; nor has tinkerd
    deadline = time.monotonic() + 15
    # No requests while waiting: the sweeper alone must delete the files.
    while any(_ckpt_dir(srv, p).exists() for p in (gone, gone_s)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _ckpt_dir(srv, gone).exists() and not _ckpt_dir(srv, gone_s).exists()
    assert _ckpt_dir(srv, keep).is_dir()
    assert [c.tinker_path for c in rest.list_checkpoints(tc.model_id).result().checkpoints] == [keep]
    assert [c.tinker_path for c in rest.list_user_checkpoints().result().checkpoints] == [keep]
    run = rest.get_training_run(tc.model_id).result()
    assert run.last_checkpoint.tinker_path == keep and run.last_sampler_checkpoint is None
    with pytest.raises(tinker.NotFoundError):
        rest.get_weights_info_by_tinker_path(gone).result()
    with pytest.raises(tinker.NotFoundError):
        sc.create_training_client_from_state(gone).result()


def _cli(server, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "TINKER_BASE_URL": server.url, "TINKER_API_KEY": API_KEY, "TINKER_TELEMETRY": "0", "COLUMNS": "400"}
    proc = subprocess.run([sys.executable, "-m", "tinker.cli", *args], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


def test_tinker_cli_lists_and_downloads_checkpoints(service_client, rest, server, tmp_path):
    tc = service_client.create_lora_training_client(base_model=TINY, rank=4, seed=4).result()
    _train(tc, 1)
    final = tc.save_state("final").result().path
    ext = tc.save_weights_external("final-ext").result().path

    listed = json.loads(_cli(server, "-f", "json", "checkpoint", "list", "--run-id", tc.model_id).stdout)
    assert sorted(c["tinker_path"] for c in listed["checkpoints"]) == sorted([final, ext])
    assert final in _cli(server, "checkpoint", "list").stdout

    _cli(server, "checkpoint", "download", final, "--output", str(tmp_path))
    got = tmp_path / final.replace("tinker://", "").replace("/", "_")
    assert sorted(os.listdir(got)) == ["adapter_config.json", "adapter_model.safetensors"]
    for name in os.listdir(got):  # the same weights as an export made directly
        assert (got / name).read_bytes() == (_ckpt_dir(server, ext) / name).read_bytes()
    # The CLI exported through a new run and deleted that temporary export afterwards.
    (helper,) = [r for r in rest.list_training_runs(limit=1000).result().training_runs
                 if (r.user_metadata or {}).get("created_by") == "tinker checkpoint download"]
    assert rest.list_checkpoints(helper.training_run_id).result().checkpoints == []
