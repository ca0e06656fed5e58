"""HPC-AI's `hpcai` 0.2.0 client (a fork of tinker SDK 0.1.5) and its bundled cookbook recipe,
unmodified, against the shared tinkerd (docs/compatibility.md, "The hpcai client").

The client pins numpy<2, so it runs in a venv of its own: built over the system site-packages and
this interpreter's (a .pth line: the tests may run from a virtualenv) with exactly
requirements/hpcai.txt installed --no-deps, under .venvs/ at a path keyed by that file's hash
(kept between runs; 330 MB, most of it pyarrow; 13.5 s of CPU and 50 s wall to build at load 12 on 2
shared cores). It must build (pip reaches PyPI in CI): if it cannot, the tests fail rather than skip.

tests/compat/hpcai_loop.py drives the client's core surface and reports what it saw; pinned here
against an uninterrupted run, the official SDK reading the same checkpoints, and the files on disk.
tests/compat/hpcai_sl_loop.py runs the client's own `recipes/sl_loop.py` offline.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import tinker
from tinker import types

from tests.conformance.conftest import TINY
from tests.serverproc import API_KEY
from tinkerd.engine.model.tiny import qwen3_tokenizer_dir

REPO = Path(__file__).resolve().parents[2]
REQUIREMENTS = REPO / "requirements" / "hpcai.txt"
VENV = REPO / ".venvs" / f"hpcai-{hashlib.sha256(REQUIREMENTS.read_bytes()).hexdigest()[:12]}"
PYTHON = VENV / "bin" / "python"
SEED = 11
# The hpcai client's identity on the wire (its User-Agent and Accept), for the raw-HTTP checks.
HPCAI_HEADERS = {"X-API-Key": API_KEY, "User-Agent": "AsyncHpcAI/Python 0.1.5", "Accept": "application/json"}
TOKENS = [9707, 11, 1879, 0, 220, 3555, 13, 1416, 2585, 525, 498, 30, 100, 200, 300, 400]
PROMPT = TOKENS[:8]


# Written once the venv's pip install has finished: a run killed mid-install (Ctrl-C, a timeout)
# leaves a venv with hpcai in it but not all its dependencies, which must be rebuilt, not reused.
BUILT = VENV / ".built"


def _client_version() -> str | None:
    if not PYTHON.exists() or not BUILT.exists():
        return None
    # From the installed metadata: importing hpcai imports torch (seconds), and the tests import it anyway.
    proc = subprocess.run([str(PYTHON), "-c", "import importlib.metadata as m; d = m.distribution('hpcai'); "
                           "print(d.version, m.version('numpy'), d.locate_file('hpcai'))"],
                          capture_output=True, text=True, timeout=300, cwd=REPO)
    return proc.stdout.strip() if proc.returncode == 0 else None


@pytest.fixture(scope="module")
def hpcai_python() -> Path:
    if _client_version() is None:
        steps = [[sys.executable, "-m", "venv", "--clear", "--system-site-packages", str(VENV)],
                 [str(PYTHON), "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-deps",
                  "-r", str(REQUIREMENTS)]]
        for k, cmd in enumerate(steps):
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
            if proc.returncode != 0:
                pytest.fail(f"cannot build the hpcai venv: {' '.join(cmd)} exited {proc.returncode}\n"
                            f"{proc.stdout}\n{proc.stderr}")
            if k == 0:
                _see_this_environment()
        BUILT.touch()
    version, numpy_version, where = (_client_version() or "? ? ?").split(" ", 2)
    assert (version, numpy_version) == ("0.2.0", "1.26.4") and Path(where).is_relative_to(VENV), (version, where)
    pulled = [p.name for p in VENV.glob("lib/python*/site-packages/*")
              if p.name.split("-")[0] in ("torch", "transformers")]
    assert not pulled, f"the venv installed its own {pulled}"
    return PYTHON


def _see_this_environment() -> None:
    """Put this interpreter's site-packages after the venv's own. `--system-site-packages` shows the
    venv only the base interpreter's, and where the tests run from a virtualenv (the README's test
    command in a fresh one) tinkerd's dependencies (httpx, torch, transformers) live in that
    virtualenv instead. A .pth line is appended to sys.path, so the venv's pinned numpy still wins."""
    import sysconfig

    paths = dict.fromkeys(sysconfig.get_paths()[k] for k in ("purelib", "platlib"))
    (site,) = VENV.glob("lib/python*/site-packages")
    (site / "tinkerd_outer_env.pth").write_text("".join(f"{p}\n" for p in paths))


def _env(server) -> dict:
    return {**os.environ, "HPCAI_BASE_URL": server.url, "HPCAI_API_KEY": API_KEY, "HPCAI_TELEMETRY": "0",
            "OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def loop(server, hpcai_python) -> dict:
    proc = subprocess.run([str(hpcai_python), str(REPO / "tests" / "compat" / "hpcai_loop.py"), TINY, str(SEED)],
                          capture_output=True, text=True, timeout=600, env=_env(server), cwd=REPO)
    assert proc.returncode == 0, f"hpcai_loop.py exited {proc.returncode}:\n{proc.stderr[-6000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _rest(server) -> tinker.RestClient:
    return tinker.RestClient(base_url=server.url, api_key=API_KEY)


SEGMENTS = {"training": "weights", "sampler": "sampler_weights"}


def _tinker_path(hpcai_path: str) -> str:
    run, kind, name = hpcai_path.removeprefix("hpcai://").split("/")
    return f"tinker://{run}/{SEGMENTS[kind]}/{name}"


def test_training_loop_and_an_exact_resume_from_saved_state(loop):
    assert TINY in loop["capabilities"]
    assert loop["info_model_name"] == TINY
    # Models of an implicit session, numbered in it.
    assert loop["model_id"].startswith("sess-hpcai-") and loop["second_model_id"].startswith("sess-hpcai-")
    assert loop["model_id"] != loop["second_model_id"] != loop["resumed_model_id"]
    losses = loop["losses"]
    assert all(b < a for a, b in zip(losses, losses[1:])), losses
    assert loop["state_path"] == f"hpcai://{loop['second_model_id']}/training/half"
    # save_state -> create_training_client_from_state -> train: the uninterrupted run's losses, exactly.
    assert loop["resumed_losses"] == losses
    assert loop["forward_output_type"] == "ArrayRecord"
    assert loop["log_records"] == [], loop["log_records"]


def test_sampling_from_saved_weights_matches_the_official_sdk(loop, service_client):
    assert loop["sampler_path"] == f"hpcai://{loop['model_id']}/sampler/w1"
    # The same checkpoint through the official SDK, by its tinker:// path: the same greedy sample.
    sc = service_client.create_sampling_client(model_path=_tinker_path(loop["sampler_path"])).result()
    params = types.SamplingParams(max_tokens=6, temperature=0.0, stop=[])
    official = sc.sample(types.ModelInput.from_ints(PROMPT), 1, params).result().sequences[0]
    sample = loop["sample"]
    assert sample["tokens"] == list(official.tokens)
    assert sample["logprobs"] == [float(x) for x in official.logprobs]
    # compute_logprobs (prompt logprobs, as JSON): the first position has none (NaN -> null), the
    # sampled tokens score as they were sampled.
    scored = sample["scored"]
    assert scored[0] is None and len(scored) == len(PROMPT) + len(sample["tokens"])
    assert all(abs(a - b) <= 1e-4 for a, b in zip(scored[len(PROMPT):], sample["logprobs"]))
    # The JSON forward at the trained weights is the sampler's score of the same tokens.
    logprobs = sc.compute_logprobs(types.ModelInput.from_ints(TOKENS)).result()
    assert math.isclose(loop["forward_loss"], -sum(logprobs[1:]) / (len(TOKENS) - 1), abs_tol=1e-4)
    # The client's own bug (docs/compatibility.md): raised before any request.
    assert "frozen" in loop["prompt_logprobs_bug"], loop["prompt_logprobs_bug"]


def test_rest_listing_in_hpcai_paths_while_the_official_sdk_sees_tinker_paths(loop, server):
    assert loop["run"] == {"id": loop["model_id"], "base_model": TINY, "lora_rank": 8,
                           "last_sampler_path": loop["sampler_path"]}
    assert loop["run_by_path"] == loop["model_id"]
    assert {loop["model_id"], loop["second_model_id"], loop["resumed_model_id"]} <= set(loop["listed_runs"])
    assert loop["second_checkpoints"] == [["half", "training", loop["state_path"]]]
    official = _rest(server).list_checkpoints(loop["second_model_id"]).result().checkpoints
    assert [(c.checkpoint_id, c.tinker_path) for c in official] == [
        ("weights/half", f"tinker://{loop['second_model_id']}/weights/half")]


def _files(directory: Path) -> dict[str, str]:
    return {f"{directory.name}/{f.relative_to(directory)}": hashlib.sha256(f.read_bytes()).hexdigest()
            for f in sorted(directory.rglob("*")) if f.is_file()}


def test_archive_download_and_bare_names(loop, server):
    ckpts = server.data_dir / "checkpoints" / loop["model_id"]
    w1 = _files(ckpts / "sampler_weights" / "w1")
    assert w1 and loop["archive_w1"] == w1 and loop["archive_w1_by_path"] == w1
    # "both" is a training and a sampler checkpoint: the bare name's archive is the sampler copy...
    both = _files(ckpts / "sampler_weights" / "both")
    assert loop["archive_both"] == both != _files(ckpts / "weights" / "both")
    # ...its delete is refused, naming both; a name of one kind is deleted.
    assert "400" in loop["delete_both_error"] and "weights/both or sampler_weights/both" in loop["delete_both_error"]
    assert loop["checkpoints_after_delete"] == ["both", "both", "w1"]
    assert not (ckpts / "sampler_weights" / "w2").exists()


def test_unload_model_releases_the_runs_adapter(loop, server):
    assert loop["unloaded"] == loop["model_id"]
    deadline = time.monotonic() + 120  # the release runs in its turn on the worker
    with httpx.Client(base_url=server.url, headers={"X-API-Key": API_KEY}, timeout=30) as http:
        # GET /api/v1/engine_status names the caller's runs released from the engine (routes/service.py).
        while loop["model_id"] not in http.get("/api/v1/engine_status").json()["released_model_ids"]:
            assert time.monotonic() < deadline, "unload_model did not release the run"
            time.sleep(0.5)


def _future(http: httpx.Client, accepted: httpx.Response) -> dict:
    assert accepted.status_code == 200, accepted.text
    while True:
        r = http.post("/api/v1/retrieve_future", json={"request_id": accepted.json()["request_id"],
                                                       "model_id": accepted.json().get("model_id")})
        if r.status_code != 408:
            assert r.status_code == 200 and r.headers["content-type"].startswith("application/json"), r.text
            return r.json()


def _fb_body(model_id: str, weights: list) -> dict:
    n = len(TOKENS) - 1
    datum = {"model_input": {"chunks": [{"type": "encoded_text", "tokens": TOKENS[:-1]}]},
             "loss_fn_inputs": {"target_tokens": {"data": TOKENS[1:], "dtype": "int64", "shape": [n]},
                                "weights": {"data": weights, "dtype": "float32", "shape": [n]}}}
    return {"model_id": model_id, "forward_backward_input": {"data": [datum], "loss_fn": "cross_entropy"}}


def test_idempotency_key_ordering_and_validation_of_json_ops(server):
    """The hpcai wire, raw: X-Idempotency-Key dedupes a re-sent op without seq_id; a model's ops are
    ordered by seq_id or by arrival, never both; a JSON body gets the protobuf body's checks."""
    with httpx.Client(base_url=server.url, headers=HPCAI_HEADERS, timeout=60) as http:
        created = _future(http, http.post("/api/v1/create_model", json={
            "base_model": TINY, "lora_config": {"rank": 4, "seed": 3}, "type": "create_model"}))
        model_id = created["model_id"]
        body = _fb_body(model_id, [1.0] * (len(TOKENS) - 1))
        first = http.post("/api/v1/forward_backward", json=body, headers={"X-Idempotency-Key": "s:0:1"})
        again = http.post("/api/v1/forward_backward", json=body, headers={"X-Idempotency-Key": "s:0:1"})
        other = http.post("/api/v1/forward_backward", json=body, headers={"X-Idempotency-Key": "s:0:2"})
        assert first.json()["request_id"] == again.json()["request_id"] != other.json()["request_id"]
        out = _future(http, first)
        assert out["loss_fn_output_type"] == "ArrayRecord" and out["loss_fn_outputs"][0]["logprobs"]["shape"] == [15]

        # An op with a seq_id on this arrival-ordered model: refused, saying why.
        mixed = http.post("/api/v1/optim_step", json={"model_id": model_id, "seq_id": 3, "type": "optim_step",
                                                      "adam_params": {"learning_rate": 1e-3}})
        assert mixed.status_code == 400 and "ordered either by seq_id or by arrival" in mixed.json()["error"]
        # The decoder's checks: a NaN weight, a shape the data does not fill, an image chunk.
        nan = http.post("/api/v1/forward_backward", content=json.dumps(_fb_body(model_id, [float("nan")] * 15)),
                        headers={"Content-Type": "application/json"})
        assert nan.status_code == 400 and "NaN" in nan.json()["error"]
        short = _fb_body(model_id, [1.0] * 14)
        short_r = http.post("/api/v1/forward_backward", json=short)
        assert short_r.status_code == 400 and "do not fill shape" in short_r.json()["error"]
        image = _fb_body(model_id, [1.0] * 15)
        image["forward_backward_input"]["data"][0]["model_input"]["chunks"][0]["type"] = "image"
        image_r = http.post("/api/v1/forward_backward", json=image)
        assert image_r.status_code == 400 and "image chunks are not supported" in image_r.json()["error"]


def test_official_sdk_ops_without_a_seq_id_on_an_sdk_model_are_refused(service_client, server):
    """The other side of the ordering rule: a model the official SDK numbers its ops on takes no
    arrival-ordered (hpcai JSON) op."""
    tc = service_client.create_lora_training_client(base_model=TINY, rank=4).result()
    datum = types.Datum(model_input=types.ModelInput.from_ints(TOKENS[:-1]),
                        loss_fn_inputs={"target_tokens": TOKENS[1:], "weights": [1.0] * 15})
    tc.forward_backward([datum], "cross_entropy").result()
    with httpx.Client(base_url=server.url, headers=HPCAI_HEADERS, timeout=60) as http:
        r = http.post("/api/v1/forward_backward", json=_fb_body(tc.model_id, [1.0] * 15))
    assert r.status_code == 400 and "ordered either by seq_id or by arrival" in r.json()["error"]


def test_the_clients_bundled_sl_loop_recipe_runs_offline(server, hpcai_python, tmp_path):
    log = tmp_path / "sl-loop"
    proc = subprocess.run([str(hpcai_python), str(REPO / "tests" / "compat" / "hpcai_sl_loop.py"), TINY,
                           str(qwen3_tokenizer_dir()), str(log)],
                          capture_output=True, text=True, timeout=600, env=_env(server), cwd=tmp_path)
    assert proc.returncode == 0, f"hpcai_sl_loop.py exited {proc.returncode}:\n{proc.stderr[-6000:]}"
    steps = [json.loads(line) for line in (log / "metrics.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == [0, 1, 2, 3] and all(math.isfinite(s["train_mean_nll"]) for s in steps)
    saved = [json.loads(line) for line in (log / "checkpoints.jsonl").read_text().splitlines()]
    assert [s["name"] for s in saved] == ["000002", "final"]
    run_id = saved[-1]["state_path"].removeprefix("hpcai://").split("/")[0]
    assert saved[-1]["state_path"] == f"hpcai://{run_id}/training/final"
    assert saved[-1]["sampler_path"] == f"hpcai://{run_id}/sampler/final"
    listed = _rest(server).list_checkpoints(run_id).result().checkpoints
    assert sorted(c.checkpoint_id for c in listed) == ["sampler_weights/final", "weights/000002", "weights/final"]
