"""The core loop through two tinker SDK releases against one live tinkerd: 0.38.0 (the system
Python's, the one the server validates requests with) and 0.36.0 (a venv this module builds).

tests/compat/sdk_loop.py runs the same loop under each and reports what it saw; pinned here: each
completes under its own SDK version with losses falling and no SDK warnings; both train, forward
and sample identically for the same seed and data; sampled logprobs equal compute_logprobs;
checkpoints round-trip (the forward after create_training_client_from_state equals the saved run's,
and one step after ..._with_optimizer equals the saved run's next step) and are listed; each SDK
takes its own load path (0.36: weights_info + create_model + a model_id-addressed load_weights;
0.38: one session-addressed load_weights), so both of the server's paths stay covered.

The venv must build (pip reaches PyPI in CI): if it cannot, the test fails rather than skips.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conformance.conftest import TINY
from tests.serverproc import API_KEY

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "tests" / "compat" / "sdk_loop.py"
NEW, OLD = "0.38.0", "0.36.0"
# Ignored by git (.gitignore); kept between runs, rebuilt when it does not import tinker OLD.
VENV = REPO / ".venvs" / f"tinker-{OLD}"
SEED = 7


def _sdk_of(python: Path) -> tuple[str, str] | None:
    """(tinker.__version__, tinker.__file__) as `python` imports it, or None if it cannot."""
    if not python.exists():
        return None
    proc = subprocess.run([str(python), "-c", "import tinker; print(tinker.__version__); print(tinker.__file__)"],
                          capture_output=True, text=True, timeout=120)
    return tuple(proc.stdout.splitlines()[-2:]) if proc.returncode == 0 else None


def _build_venv() -> None:
    shutil.rmtree(VENV, ignore_errors=True)
    # --system-site-packages: torch, transformers and the SDK's other dependencies come from the
    # system install, so pip fetches only the tinker wheel itself.
    steps = [[sys.executable, "-m", "venv", "--system-site-packages", str(VENV)],
             [str(VENV / "bin" / "python"), "-m", "pip", "install", "-q", "--disable-pip-version-check",
              f"tinker=={OLD}"]]
    for cmd in steps:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        if proc.returncode != 0:
            pytest.fail(f"cannot build the tinker {OLD} venv: {' '.join(cmd)} exited {proc.returncode}\n"
                        f"{proc.stdout}\n{proc.stderr}")
    pulled = [p.name for p in VENV.glob("lib/python*/site-packages/*") if p.name.split("-")[0].lower() == "torch"]
    assert not pulled, f"pip installed its own torch into the venv: {pulled}"


@pytest.fixture(scope="module")
def old_python() -> Path:
    python = VENV / "bin" / "python"
    if (_sdk_of(python) or ("",))[0] != OLD:
        _build_venv()
    version, where = _sdk_of(python) or ("not importable", "")
    assert version == OLD and Path(where).is_relative_to(VENV), f"venv imports tinker {version} from {where}"
    return python


def _run(python: Path, server) -> dict:
    env = {**os.environ, "TINKER_BASE_URL": server.url, "TINKER_API_KEY": API_KEY}
    proc = subprocess.run([str(python), str(SCRIPT), TINY, str(SEED)], capture_output=True, text=True,
                          timeout=180, env=env, cwd=REPO)
    assert proc.returncode == 0, f"{SCRIPT.name} under {python} exited {proc.returncode}:\n{proc.stderr[-5000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def runs(server, old_python) -> dict[str, dict]:
    # One after the other: both on 2 cores, and each run's numbers come from an otherwise idle server.
    return {NEW: _run(Path(sys.executable), server), OLD: _run(old_python, server)}


@pytest.mark.parametrize("version", [NEW, OLD])
def test_loop_completes_under_each_sdk_with_losses_falling(runs, version):
    out = runs[version]
    assert out["sdk_version"] == version
    assert out["info_base_model"] == TINY
    assert all(b < a for a, b in zip(out["losses"], out["losses"][1:])), out["losses"]
    assert out["saved_next"]["loss"] < out["saved"]["loss"]
    # Nothing at WARNING or above, under either SDK: in particular no "Retrying request ... because of
    # try_again", which both log for every try_again answered as a 200.
    assert out["log_records"] == [], out["log_records"]
    assert out["warnings"] == [], out["warnings"]


def test_both_sdks_train_sample_and_restore_identically(runs):
    new, old = runs[NEW], runs[OLD]
    assert new["model_id"] != old["model_id"]
    for key in ("losses", "saved", "saved_next", "from_state", "from_state_with_optimizer_next"):
        assert old[key] == new[key], key
    for key in ("sample_saved", "sample_ephemeral"):
        assert old[key]["tokens"] == new[key]["tokens"], key
        assert old[key]["logprobs"] == new[key]["logprobs"], key


@pytest.mark.parametrize("version", [NEW, OLD])
def test_sampled_logprobs_equal_compute_logprobs(runs, version):
    out = runs[version]
    # The same trained weights, through a saved sampler path and an ephemeral sampler.
    assert out["sample_saved"]["tokens"] == out["sample_ephemeral"]["tokens"]
    for key in ("sample_saved", "sample_ephemeral"):
        s = out[key]
        assert len(s["tokens"]) == len(s["logprobs"]) == len(s["reference"]) > 0
        assert all(abs(a - b) <= 1e-4 for a, b in zip(s["logprobs"], s["reference"])), (s["logprobs"], s["reference"])


@pytest.mark.parametrize("version", [NEW, OLD])
def test_checkpoints_round_trip_and_list(runs, version):
    out = runs[version]
    mid = out["model_id"]
    assert out["from_state"] == out["saved"]
    assert out["from_state_with_optimizer_next"] == out["saved_next"]
    assert out["state_path"] == f"tinker://{mid}/weights/state"
    assert out["sampler_path"] == f"tinker://{mid}/sampler_weights/sampler"
    # Listed before the external export, so exactly the two saved ones.
    assert out["listed"] == sorted([out["state_path"], out["sampler_path"]])
    assert set(out["listed"]) <= set(out["listed_user"])
    assert out["weights_info"] == {"base_model": TINY, "lora_rank": 8}
    assert out["training_run_base_model"] == TINY
    assert "adapter_model.safetensors" in out["external_files"] and out["external_first_file_bytes"] > 0


def _load_weights(out: dict) -> list[dict]:
    return [r for r in out["requests"] if r["path"] == "/api/v1/load_weights"]


def test_each_sdk_takes_its_own_load_path(runs):
    # 0.36 only sends one load_weights per restored client when client_config does not offer
    # create_model_via_load_weights (tinkerd does not): it looks the checkpoint up, creates the
    # model, then loads into it by model_id. 0.38 always creates the model with the load itself.
    old_loads, new_loads = _load_weights(runs[OLD]), _load_weights(runs[NEW])
    assert len(old_loads) == len(new_loads) == 2
    assert all(r["model_id_set"] and "seq_id" in r["fields"] for r in old_loads), old_loads
    assert all(not r["model_id_set"] and {"session_id", "model_seq_id"} <= set(r["fields"]) for r in new_loads)
    old_paths = [r["path"] for r in runs[OLD]["requests"]]
    # One lookup per restored client, plus the script's own get_weights_info_by_tinker_path.
    assert old_paths.count("/api/v1/weights_info") == 3
