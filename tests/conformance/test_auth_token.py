"""The SDK's auth exchange against tinkerd (pjwt_auth_enabled): POST /api/v1/auth/token answers a JWT
signed by the server, the SDK then sends it instead of its key, `RestClient.whoami` reads its claims,
a revoked key's JWT stops working at once, and a forged, tampered or expired one is a 401 that says
invalid_token (the SDK's cue to exchange again)."""

from __future__ import annotations

import time

import httpx
import jwt as pyjwt
import pytest
import tinker
from tinker.lib._jwt_auth import JwtAuthProvider, jwt_claims

from tests.conformance.conftest import TINY
from tests.conformance.test_ownership import _key
from tinkerd.control.tokens import Tokens


def _token(server, key: str) -> str:
    r = httpx.post(f"{server.url}/api/v1/auth/token", json={}, headers={"X-API-Key": key}, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()["jwt"]


def _me(server, credential: str) -> httpx.Response:
    return httpx.get(f"{server.url}/api/v1/auth/apikey/me", headers={"X-API-Key": credential}, timeout=30)


def test_the_sdk_exchanges_its_key_and_sends_the_jwt(server, monkeypatch):
    key = _key(server.data_dir, "gina-token")
    fetched: list[str] = []
    real = JwtAuthProvider._fetch

    async def spy(self):
        fetched.append(await real(self))
        return fetched[-1]

    monkeypatch.setattr(JwtAuthProvider, "_fetch", spy)
    sc = tinker.ServiceClient(base_url=server.url, api_key=key)
    tc = sc.create_lora_training_client(base_model=TINY, rank=4).result()  # works on the JWT alone
    me = tinker.RestClient(base_url=server.url, api_key=key).whoami().result()
    assert fetched and all(t.startswith("eyJ") for t in fetched)
    claims = jwt_claims(fetched[0])
    assert me.email == "gina-token" and me.user_urn == claims["sub"] and me.org_urn == f"tml:organization:{claims['org_id']}"
    assert 0 < claims["exp"] - claims["iat"] <= 3600 and key not in fetched[0]
    assert tc.model_id in [r.training_run_id for r in
                           tinker.RestClient(base_url=server.url, api_key=fetched[0]).list_training_runs().result().training_runs]


def test_a_jwt_is_the_key_it_was_issued_for_until_that_key_is_revoked(server):
    from tinker.cli.auth_api import TinkerAuthApi

    key = _key(server.data_dir, "hugo-token")
    token = _token(server, key)
    assert _me(server, token).json() == _me(server, key).json()
    assert _token(server, token)  # a JWT may be exchanged for a fresh one
    with httpx.Client() as client:
        TinkerAuthApi(client, base_url=server.url).delete_self_api_key(key)
    r = _me(server, token)
    assert r.status_code == 401 and 'error="invalid_token"' in r.headers["www-authenticate"]
    assert r.json()["category"] == "user" and "revoked" in r.json()["error"]
    assert httpx.post(f"{server.url}/api/v1/auth/token", json={}, headers={"X-API-Key": key}).status_code == 401


@pytest.mark.parametrize("forge", ["other_secret", "tampered", "expired", "garbage", "no_key_id"])
def test_forged_tampered_and_expired_tokens_are_refused(server, forge):
    key = _key(server.data_dir, f"ivy-{forge}")
    token = _token(server, key)
    claims = jwt_claims(token)
    real = Tokens.in_dir(server.data_dir)
    if forge == "other_secret":
        bad = Tokens(b"x" * 32).issue(claims["org_id"], "ivy", claims["key_id"])
    elif forge == "tampered":  # another account's id with the signature of this one's token
        head, _, sig = token.split(".")
        other = pyjwt.encode({**claims, "org_id": "acct-000000000000"}, "k" * 32, algorithm="HS256").split(".")[1]
        bad = f"{head}.{other}.{sig}"
    elif forge == "expired":
        bad = pyjwt.encode({**claims, "iat": int(time.time()) - 7200, "exp": int(time.time()) - 10},
                           real._secret, algorithm="HS256")
    elif forge == "garbage":
        bad = "eyJhbGciOi.x.y"
    else:
        bad = pyjwt.encode({k: v for k, v in claims.items() if k != "key_id"}, real._secret, algorithm="HS256")
    r = _me(server, bad)
    assert r.status_code == 401 and r.json()["category"] == "user", r.text
    assert 'error="invalid_token"' in r.headers["www-authenticate"]
