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

`tinkerd keys rotate-token-secret` (`rotate`) replaces the file whole (a new inode, by rename); the
server stats it before each signature or check (one stat: ~8 us, against ~85 us for PyJWT's whole
HS256 check, measured on the shared 2-core CI machine) and reads it again when it changed, so every token signed before (SDK JWTs, console cookies,
trace-export links) is refused from the next request on, with no restart. API keys are not tokens:
they keep working, and the SDK trades its key for a new JWT on the 401 (invalid_token).
"""

from __future__ import annotations

import logging
import os
import secrets
import threading
import time
from pathlib import Path

import jwt

ALGORITHM = "HS256"
ISSUER = "tinkerd"
# The SDK refreshes at ~half of exp - iat and on demand in the last 60 s: an hour means one exchange
# per client per ~30 minutes.
TOKEN_LIFETIME_S = 3600
SECRET_FILE = "jwt_signing_key"

log = logging.getLogger(__name__)


class InvalidToken(Exception):
    pass


def looks_like_jwt(credential: str) -> bool:
    """A JWT (three base64url parts, header first) rather than a `tml-` API key."""
    return credential.startswith("eyJ") and credential.count(".") == 2


class Tokens:
    def __init__(self, secret: bytes, lifetime_s: int = TOKEN_LIFETIME_S, path: Path | None = None):
        self._secret = secret
        self.lifetime_s = lifetime_s
        # The secret's file, followed for rotations; None: a fixed secret (tests). _seen: the file's
        # identity when it was last read; None until the first check, which reads it again (so a
        # rotation between the first read and this object cannot go unseen).
        self._path = path
        self._seen: tuple[int, int, int] | None = None
        self._lock = threading.Lock()

    @classmethod
    def in_dir(cls, data_dir: Path) -> Tokens:
        """The data directory's signing secret, created (0600, written whole) on first use."""
        path = Path(data_dir) / SECRET_FILE
        if not path.exists():
            tmp = _write_private(path)
            try:
                os.link(tmp, path)  # never replaces a secret another process made meanwhile
            except FileExistsError:
                pass
            finally:
                tmp.unlink()
        return cls(_read(path), path=path)

    @staticmethod
    def rotate(data_dir: Path) -> Path:
        """Replace the data directory's signing secret with a new one (made if there was none);
        servers on this directory refuse every token signed before from their next check on."""
        path = Path(data_dir) / SECRET_FILE
        os.replace(_write_private(path), path)  # atomic: a reader sees the old secret or the new, whole
        dir_fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)  # the rename survives a power cut: an old token must not come back to life
        finally:
            os.close(dir_fd)
        return path

    @property
    def secret(self) -> bytes:
        """The current signing secret: read again once the file was replaced (rotate)."""
        if self._path is None:
            return self._secret
        now = _identity(self._path)
        if now is not None and now != self._seen:
            with self._lock:
                if now != self._seen:
                    rotated = self._seen is not None
                    self._secret, self._seen = _read(self._path), now
                    if rotated:
                        log.warning("the token signing secret in %s was replaced: tokens signed before are "
                                    "refused", self._path)
        return self._secret

    def issue(self, account_id: str, account_name: str, key_id: str) -> str:
        now = int(time.time())
        claims = {"iss": ISSUER, "sub": f"tml:user:{account_id}", "org_id": account_id, "email": account_name,
                  "key_id": key_id, "iat": now, "exp": now + self.lifetime_s}
        return jwt.encode(claims, self.secret, algorithm=ALGORITHM)

    def sign_url_token(self, audience: str, claims: dict, lifetime_s: int) -> str:
        """A token for a signed download URL (trace_export): `aud` keeps it from passing `verify`
        (an auth token), and an auth token from passing `verify_url_token`."""
        now = int(time.time())
        return jwt.encode({**claims, "iss": ISSUER, "aud": audience, "iat": now, "exp": now + lifetime_s},
                          self.secret, algorithm=ALGORITHM)

    def verify_url_token(self, token: str, audience: str) -> dict:
        try:
            return jwt.decode(token, self.secret, algorithms=[ALGORITHM], issuer=ISSUER, audience=audience,
                              options={"require": ["exp", "aud"]})
        except jwt.ExpiredSignatureError:
            raise InvalidToken("the link has expired") from None
        except jwt.InvalidTokenError as e:
            raise InvalidToken(f"invalid link: {e}") from None

    def verify(self, token: str) -> dict:
        """The claims of a token this server signed and that has not expired; InvalidToken otherwise."""
        try:
            return jwt.decode(token, self.secret, algorithms=[ALGORITHM], issuer=ISSUER,
                              options={"require": ["exp", "iat", "sub", "org_id", "key_id"]})
        except jwt.ExpiredSignatureError:
            raise InvalidToken("the token has expired") from None
        except jwt.InvalidTokenError as e:
            raise InvalidToken(f"invalid token: {e}") from None


def _identity(path: Path) -> tuple[int, int, int] | None:
    """What changes when the file is replaced or rewritten; None while it is missing (the secret
    read last stays in use: a deleted file is not a rotation)."""
    try:
        st = path.stat()
    except FileNotFoundError:
        return None
    return st.st_ino, st.st_mtime_ns, st.st_size


def _read(path: Path) -> bytes:
    return bytes.fromhex(path.read_text().strip())


def _write_private(path: Path) -> Path:
    """A new secret in a temporary file beside `path` (0600, synced), for the caller to move in place."""
    tmp = path.with_name(f".{SECRET_FILE}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32))
        f.flush()
        os.fsync(f.fileno())
    return tmp
