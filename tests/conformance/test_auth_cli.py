"""`tinker auth login/status/logout` (the SDK's own CLI, as a subprocess) against tinkerd's
GET/DELETE /api/v1/auth/apikey/me, with a temporary HOME so its credential file is the test's."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import httpx
import pytest

from tests.conformance.test_ownership import _key


def _tinker(home, server, *args, stdin: str | None = None, key: str | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TINKER_")}
    env.update(HOME=str(home), TINKER_BASE_URL=server.url)
    if key:
        env["TINKER_API_KEY"] = key
    return subprocess.run([sys.executable, "-m", "tinker.cli", *args], input=stdin, capture_output=True, text=True,
                          env=env, timeout=120)


def test_login_status_logout_with_the_stored_key(server, tmp_path):
    key = _key(server.data_dir, "carol-auth")
    out = _tinker(tmp_path, server, "auth", "login", stdin=key + "\n")
    assert out.returncode == 0, out.stderr + out.stdout
    assert "Logged in as carol-auth (carol-auth)" in out.stdout and key not in out.stdout + out.stderr
    stored = json.loads((tmp_path / ".tinker" / "credentials.json").read_text())
    assert stored["keys"][stored["default"]]["key"] == key
    # status resolves the stored credential (no TINKER_API_KEY in the environment) and reaches the server.
    status = _tinker(tmp_path, server, "auth", "status")
    assert status.returncode == 0 and "Tinker accessible: yes" in status.stdout, status.stderr + status.stdout
    out = _tinker(tmp_path, server, "auth", "logout")
    assert out.returncode == 0 and "The API key is still active" in out.stdout, out.stderr + out.stdout
    assert httpx.get(f"{server.url}/api/v1/auth/apikey/me", headers={"X-API-Key": key}).status_code == 200


def test_login_refuses_a_bad_key(server, tmp_path):
    out = _tinker(tmp_path, server, "auth", "login", stdin="tml-not-a-key\n")
    assert out.returncode != 0 and "HTTP 401 from /api/v1/auth/apikey/me" in out.stdout + out.stderr
    assert not (tmp_path / ".tinker" / "credentials.json").exists()


def test_me_shape_and_delete_revokes_only_the_presented_key(server):
    from tinker.cli.auth_api import TinkerAuthApi

    key, other = _key(server.data_dir, "dave-auth"), _key(server.data_dir, "dave-auth")
    with httpx.Client() as client:
        api = TinkerAuthApi(client, base_url=server.url)
        me = api.get_self_api_key(key)
        assert me.name == "dave-auth-key" and me.details.org_details.name == "dave-auth"
        assert key not in json.dumps(me.model_dump())
        api.delete_self_api_key(key)
    assert httpx.get(f"{server.url}/api/v1/auth/apikey/me", headers={"X-API-Key": key}).status_code == 401
    assert httpx.get(f"{server.url}/api/v1/auth/apikey/me", headers={"X-API-Key": other}).status_code == 200


def test_logout_of_a_generated_key_deletes_it_on_the_server(server, tmp_path):
    key = _key(server.data_dir, "erin-auth")
    record = {"type": "generated", "key": key, "name": "erin-cli",
              "details": {"org_details": {"name": "erin-auth"}, "user_details": {"email": "erin-auth"}}}
    (tmp_path / ".tinker").mkdir()
    (tmp_path / ".tinker" / "credentials.json").write_text(json.dumps({"version": 1, "default": "1", "keys": {"1": record}}))
    out = _tinker(tmp_path, server, "auth", "logout")
    assert out.returncode == 0 and "deleted its API key on the server" in out.stdout, out.stderr + out.stdout
    assert httpx.get(f"{server.url}/api/v1/auth/apikey/me", headers={"X-API-Key": key}).status_code == 401


def test_whoami_reads_the_claims_of_the_servers_jwt(server, tmp_path):
    key = _key(server.data_dir, "frank-auth")
    out = _tinker(tmp_path, server, "--format", "json", "auth", "whoami", key=key)
    assert out.returncode == 0, out.stderr + out.stdout
    me = json.loads(out.stdout)
    account_id = me["org_urn"].removeprefix("tml:organization:")
    assert me == {"user_urn": f"tml:user:{account_id}", "org_urn": f"tml:organization:{account_id}",
                  "email": "frank-auth"}
    assert account_id.startswith("acct-") and key not in out.stdout + out.stderr
