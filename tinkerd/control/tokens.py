"""Short-lived JWTs for the SDK's auth exchange (POST /api/v1/auth/token).

tinkerd's client config sets `pjwt_auth_enabled`, so the SDK trades its API key for a JWT once,
sends the JWT as X-API-Key on every request, and refreshes it at about half its lifetime; the
identity claims are what `RestClient.whoami` and `tinker auth whoami` read. The claims:

- sub: `tml:user:<account_id>` (tinkerd has accounts, not users: the account is both)
- org_id: the account id (the SDK reports `tml:organization:<org_id>`)
- email: the account's name, as auth/apikey/me reports it
- key_id: the API key it was issued for; a request with the JWT is refused as soon as that key is
  revoked, so revoking a key does not wait out the token's lifetime
- iat / exp: issued at, and TOKEN_LIFETIME_S later

Signed with HS256 (PyJWT) by a 256-bit secret kept in the data directory (mode 0600), made on first
start: tokens stay valid across restarts, and nobody without the data directory can mint one.
"""

from __future__ import annotations

import os
import secrets
import time
from pathlib import Path

import jwt

ALGORITHM = "HS256"
ISSUER = "tinkerd"
# The SDK refreshes at ~half of exp - iat and on demand in the last 60 s: an hour means one exchange
# per client per ~30 minutes.
TOKEN_LIFETIME_S = 3600
SECRET_FILE = "jwt_signing_key"


class InvalidToken(Exception):
    pass


def looks_like_jwt(credential: str) -> bool:
    """A JWT (three base64url parts, header first) rather than a `tml-` API key."""
    return credential.startswith("eyJ") and credential.count(".") == 2


class Tokens:
    def __init__(self, secret: bytes, lifetime_s: int = TOKEN_LIFETIME_S):
        self._secret = secret
        self.lifetime_s = lifetime_s

    @classmethod
    def in_dir(cls, data_dir: Path) -> Tokens:
        """The data directory's signing secret, created (0600, written whole) on first use."""
        path = Path(data_dir) / SECRET_FILE
        if not path.exists():
            tmp = path.with_name(f".{SECRET_FILE}.{os.getpid()}.tmp")
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(secrets.token_hex(32))
                f.flush()
                os.fsync(f.fileno())
            try:
                os.link(tmp, path)  # never replaces a secret another process made meanwhile
            except FileExistsError:
                pass
            finally:
                tmp.unlink()
        return cls(bytes.fromhex(path.read_text().strip()))

    def issue(self, account_id: str, account_name: str, key_id: str) -> str:
        now = int(time.time())
        claims = {"iss": ISSUER, "sub": f"tml:user:{account_id}", "org_id": account_id, "email": account_name,
                  "key_id": key_id, "iat": now, "exp": now + self.lifetime_s}
        return jwt.encode(claims, self._secret, algorithm=ALGORITHM)

    def sign_url_token(self, audience: str, claims: dict, lifetime_s: int) -> str:
        """A token for a signed download URL (trace_export): `aud` keeps it from passing `verify`
        (an auth token), and an auth token from passing `verify_url_token`."""
        now = int(time.time())
        return jwt.encode({**claims, "iss": ISSUER, "aud": audience, "iat": now, "exp": now + lifetime_s},
                          self._secret, algorithm=ALGORITHM)

    def verify_url_token(self, token: str, audience: str) -> dict:
        try:
            return jwt.decode(token, self._secret, algorithms=[ALGORITHM], issuer=ISSUER, audience=audience,
                              options={"require": ["exp", "aud"]})
        except jwt.ExpiredSignatureError:
            raise InvalidToken("the link has expired") from None
        except jwt.InvalidTokenError as e:
            raise InvalidToken(f"invalid link: {e}") from None

    def verify(self, token: str) -> dict:
        """The claims of a token this server signed and that has not expired; InvalidToken otherwise."""
        try:
            return jwt.decode(token, self._secret, algorithms=[ALGORITHM], issuer=ISSUER,
                              options={"require": ["exp", "iat", "sub", "org_id", "key_id"]})
        except jwt.ExpiredSignatureError:
            raise InvalidToken("the token has expired") from None
        except jwt.InvalidTokenError as e:
            raise InvalidToken(f"invalid token: {e}") from None
