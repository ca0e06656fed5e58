"""API keys: no open server by default; keys are created, listed and revoked from the CLI."""

from __future__ import annotations

import subprocess
import sys

import httpx
import pytest
import tinker

from tests.serverproc import start_server

TINY = "tinkerd/tiny-qwen3"


def _keys(data_dir, *args) -> str:
    out = subprocess.run([sys.executable, "-m", "tinkerd.cli.main", "keys", "--data-dir", str(data_dir), *args],
                         capture_output=True, text=True, check=True)
    return out.stdout


@pytest.fixture(scope="module")
def keyless_server(tmp_path_factory):
    data_dir = tmp_path_factory.mktemp("keys-data")
    srv = start_server(data_dir, [TINY], api_key=None)
    yield srv
    srv.stop()


def test_first_start_creates_and_prints_a_local_key(keyless_server):
    ready = "".join(keyless_server.lines)
    key = ready.split("TINKER_API_KEY=")[1].split()[0]
    assert key.startswith("tml-") and len(key) > 30
    stored = (keyless_server.data_dir / "local_api_key")
    assert stored.read_text().strip() == key and (stored.stat().st_mode & 0o777) == 0o600
    # Only a hash is stored in the database.
    assert key.encode() not in (keyless_server.data_dir / "tinkerd.sqlite").read_bytes()
    sc = tinker.ServiceClient(base_url=keyless_server.url, api_key=key)
    tc = sc.create_lora_training_client(base_model=TINY, rank=4).result()
    assert tc.forward_backward([tinker.types.Datum(model_input=tinker.types.ModelInput.from_ints([1, 2]),
                                                   loss_fn_inputs={"target_tokens": [2, 3]})], "cross_entropy").result()
    r = httpx.post(f"{keyless_server.url}/api/v1/create_session", json={"tags": [], "sdk_version": "0.38.0"},
                   headers={"X-API-Key": "tml-not-a-key"})
    assert r.status_code == 401 and r.json()["category"] == "user"


def test_keys_create_list_revoke_while_serving(keyless_server):
    out = _keys(keyless_server.data_dir, "create", "--name", "ci-bot", "--account", "bob")
    key = out.split("TINKER_API_KEY=")[1].split()[0]
    key_id = out.split()[1]
    headers = {"X-API-Key": key}
    body = {"tags": [], "user_metadata": {}, "sdk_version": "0.38.0"}
    assert httpx.post(f"{keyless_server.url}/api/v1/create_session", json=body, headers=headers).status_code == 200
    listing = _keys(keyless_server.data_dir, "list")
    assert key_id in listing and "ci-bot" in listing and "bob" in listing and key not in listing
    _keys(keyless_server.data_dir, "revoke", key_id)
    r = httpx.post(f"{keyless_server.url}/api/v1/create_session", json=body, headers=headers)
    assert r.status_code == 401 and "revoked" in r.json()["error"]
