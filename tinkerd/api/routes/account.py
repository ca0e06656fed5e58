"""The caller's own key and account: `tinker auth login/logout` (auth/apikey/me) and the audit log
(AdminClient.get_audit_log).

auth/apikey/me answers the CLI's SelfApiKeyResponse (tinker/cli/auth_api.py): `key_id` is an
integer there, so tinkerd's `key-<12 hex>` id goes out as that hex number (the note names the id
`tinkerd keys` shows). tinkerd has accounts, not users and organisations: the account's name fills
both the organisation name and the user's "email". The key itself is never echoed.
"""

from __future__ import annotations

from datetime import date, datetime, timezone

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from tinkerd.api.deps import account, authenticate, empty, state
from tinkerd.control.audit import EVENT_TYPES, day_window
from tinkerd.control.ids import iso
from tinkerd.control.records import ApiKey
from tinkerd.errors import UserError

router = APIRouter(prefix="/api/v1", dependencies=[Depends(authenticate)])


def _caller_key(request: Request) -> ApiKey:
    # authenticate() accepted the key (or a JWT issued for it), so the row exists and is not revoked.
    return state(request).accounts.key_by_id(request.state.key_id)


@router.post("/auth/token")
def auth_token(request: Request) -> dict:
    """The SDK's auth exchange (pjwt_auth_enabled): a short-lived JWT for the presented key, carrying
    the identity claims `whoami` reads (control/tokens.py)."""
    st = state(request)
    row = _caller_key(request)
    name = st.accounts.account_name(row.account_id) or row.account_id
    return {"jwt": st.tokens.issue(row.account_id, name, row.key_id)}


@router.get("/auth/apikey/me")
def get_self_api_key(request: Request) -> dict:
    row = _caller_key(request)
    name = state(request).accounts.account_name(row.account_id) or row.account_id
    return {
        "key_id": int(row.key_id.removeprefix("key-"), 16),
        "name": row.name,
        "note": f"tinkerd key {row.key_id} of account {name}",
        "details": {"org_details": {"name": name}, "user_details": {"email": name}},
    }


@router.delete("/auth/apikey/me")
def delete_self_api_key(request: Request) -> Response:
    # Revokes the presented key only (the CLI's logout contract): never another key of the account.
    state(request).accounts.revoke(_caller_key(request).key_id, via="DELETE /api/v1/auth/apikey/me")
    return empty()


@router.get("/audit")
def get_audit_log(request: Request, event_type: str = "all", day: str | None = None) -> dict:
    if event_type not in EVENT_TYPES:
        raise UserError(f"event_type must be one of {sorted(EVENT_TYPES)}, got {event_type!r}")
    try:
        when = date.fromisoformat(day) if day is not None else datetime.now(timezone.utc).date()
    except ValueError as e:
        raise UserError(f"day must be a date such as 2026-01-15, got {day!r}") from e
    start, end = day_window(datetime(when.year, when.month, when.day))
    # The accounts' log, because it holds the in-memory counts of failed authentications (flushed
    # by the read); every AuditLog writes the same table.
    rows = state(request).accounts.audit.entries(account(request), start, end, event_type)
    entries = []
    for r in rows:
        details = {**(r.details or {}), **({"count": r.count} if r.count != 1 else {})}
        entries.append({"timestamp": iso(r.at), "event": r.event, "event_details": details,
                        "model_id": details.get("model_id"), "tinker_path": details.get("tinker_path"),
                        "purpose": None})
    return {"entries": entries}
