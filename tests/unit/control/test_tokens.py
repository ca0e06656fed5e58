"""control/tokens.py: the signing secret is made once per data directory (0600) and kept across
restarts; tokens carry the identity claims and expire; a rotation refuses every earlier token at
the next check of a running server's Tokens."""

from __future__ import annotations

import stat

import pytest

from tinkerd.control.tokens import InvalidToken, Tokens, looks_like_jwt


def test_the_secret_is_made_once_private_and_kept(tmp_path):
    a = Tokens.in_dir(tmp_path)
    token = a.issue("acct-1", "alice", "key-1")
    assert stat.S_IMODE((tmp_path / "jwt_signing_key").stat().st_mode) == 0o600
    assert Tokens.in_dir(tmp_path).verify(token)["org_id"] == "acct-1"  # a restarted server accepts it
    assert not list(tmp_path.glob(".*tmp"))
    with pytest.raises(InvalidToken, match="invalid"):
        Tokens(b"another server" * 3).verify(token)


def test_claims_and_expiry(tmp_path):
    tokens = Tokens.in_dir(tmp_path)
    claims = tokens.verify(tokens.issue("acct-2", "bob", "key-2"))
    assert (claims["sub"], claims["email"], claims["key_id"], claims["exp"] - claims["iat"]) == \
        ("tml:user:acct-2", "bob", "key-2", 3600)
    expired = Tokens(tokens._secret, lifetime_s=-10).issue("acct-2", "bob", "key-2")
    with pytest.raises(InvalidToken, match="expired"):
        tokens.verify(expired)
    assert looks_like_jwt(expired) and not looks_like_jwt("tml-abc.def.ghi")


def test_a_rotated_secret_refuses_earlier_tokens_at_the_next_check(tmp_path):
    running = Tokens.in_dir(tmp_path)  # a server's, made at its start
    before = running.issue("acct-3", "carl", "key-3")
    link = running.sign_url_token("trace", {"session": "s"}, 60)
    assert running.verify(before)["org_id"] == "acct-3"
    Tokens.rotate(tmp_path)  # what `tinkerd keys rotate-token-secret` does, from another process
    with pytest.raises(InvalidToken, match="invalid"):
        running.verify(before)
    with pytest.raises(InvalidToken, match="invalid"):
        running.verify_url_token(link, "trace")
    after = running.issue("acct-3", "carl", "key-3")
    assert running.verify(after)["org_id"] == "acct-3" and Tokens.in_dir(tmp_path).verify(after)
    assert stat.S_IMODE((tmp_path / "jwt_signing_key").stat().st_mode) == 0o600
    assert not list(tmp_path.glob(".*tmp"))
