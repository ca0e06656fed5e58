"""Console sign-in: an API key once, then an HttpOnly session cookie.

The cookie is a JWT signed with the server's token secret (control/tokens.py) for the audience
`tinkerd-console`, so it is neither accepted as an API credential nor an API token as a cookie. It
carries the account, the key it was signed in with and a random CSRF token, and expires after
SESSION_S. Every request checks the key again: revoking the key (`tinkerd keys revoke`, `tinker
auth logout`) ends its console sessions at once, as it ends its JWTs.

CSRF: every mutating form carries the session's CSRF token, compared in constant time; the cookie is
also SameSite=Strict, so another site's form never sends it.
"""

from __future__ import annotations

import hmac
import secrets
from dataclasses import dataclass
from urllib.parse import parse_qs, urlsplit

from fastapi import Request
from fastapi.responses import Response

from tinkerd.api.deps import read_body, state
from tinkerd.control.tokens import InvalidToken
from tinkerd.errors import CsrfError, SignInRequired, UserError

COOKIE = "tinkerd_console"
AUDIENCE = "tinkerd-console"
# A working day: long enough not to interrupt someone watching a run, short enough that a cookie
# left on a shared machine stops working by the next day.
SESSION_S = 8 * 3600
# A sign-in or mutation form is a few hundred bytes; this refuses anything else before parsing.
MAX_FORM_BYTES = 16 * 1024


@dataclass
class Viewer:
    account_id: str
    account_name: str
    key_id: str
    csrf: str


def start(request: Request, response: Response, account_id: str, key_id: str) -> None:
    """Sign the caller in: set the session cookie on `response`."""
    token = state(request).tokens.sign_url_token(
        AUDIENCE, {"account_id": account_id, "key_id": key_id, "csrf": secrets.token_urlsafe(24)}, SESSION_S)
    response.set_cookie(COOKIE, token, max_age=SESSION_S, path="/console", httponly=True, samesite="strict",
                        secure=request.url.scheme == "https")


def end(response: Response) -> None:
    response.delete_cookie(COOKIE, path="/console", httponly=True, samesite="strict")


def viewer(request: Request) -> Viewer:
    """The signed-in account, or SignInRequired (no cookie, a bad or expired one, a revoked key)."""
    st = state(request)
    cookie = request.cookies.get(COOKIE)
    if not cookie or st.tokens is None:
        raise SignInRequired("sign in with an API key")
    try:
        claims = st.tokens.verify_url_token(cookie, AUDIENCE)
    except InvalidToken as e:
        raise SignInRequired(f"your console session ended ({e.args[0]}); sign in again") from None
    row = st.accounts.key_by_id(str(claims.get("key_id")))
    if row is None or row.revoked_at is not None or row.account_id != claims.get("account_id"):
        raise SignInRequired("the API key this session was signed in with is revoked; sign in with another")
    name = st.accounts.account_name(row.account_id) or row.account_id
    request.state.account_id = row.account_id
    return Viewer(row.account_id, name, row.key_id, str(claims.get("csrf", "")))


async def form(request: Request) -> dict[str, str]:
    """An application/x-www-form-urlencoded body (the console's forms), first value of each field.
    A browser's form post from another site's page is refused by its Origin header; this also covers
    the sign-in form, which has no session (and so no CSRF token) yet."""
    origin = request.headers.get("origin")
    if origin is not None and origin != "null" and urlsplit(origin).netloc != request.headers.get("host"):
        raise CsrfError(f"a form posted from {origin} is refused: the console accepts its own pages' forms only")
    limit = min(state(request).config.max_body_bytes, MAX_FORM_BYTES)
    body = await read_body(request)
    if len(body) > limit:
        raise UserError(f"form over {limit} bytes")
    try:
        fields = parse_qs(body.decode(), keep_blank_values=True, strict_parsing=False, max_num_fields=32)
    except (UnicodeDecodeError, ValueError) as e:
        raise UserError(f"unreadable form: {e}") from e
    return {k: v[0] for k, v in fields.items()}


def check_csrf(who: Viewer, fields: dict[str, str]) -> None:
    if not who.csrf or not hmac.compare_digest(fields.get("csrf", ""), who.csrf):
        raise CsrfError("this form is stale or came from another site (CSRF token mismatch); reload the page")
