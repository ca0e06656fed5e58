"""The SDK's AdminClient billing surface: hourly usage events and current checkpoint storage.

Every caller sees its own account's usage only (tinkerd has no organisations; an account is one).
Costs are estimates from the configured prices (ServerConfig.price_*), applied at read time.
Queue wait is recorded with each op (`tinkerd usage` shows it) and is never part of a quantity here.
Checkpoint storage comes as the SDK's `storage` events: GB-hours per hour and base model, with no
session (control/storage.py).
"""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

from fastapi import APIRouter, Depends, Request

from tinkerd.api.deps import account, authenticate, state
from tinkerd.control.metering import TOKEN_KINDS, bucket_end, hourly_buckets
from tinkerd.control.ids import iso
from tinkerd.control.storage import BYTES_PER_GB, STORAGE_KIND, gb_hour_buckets, storage_cost_usd
from tinkerd.control.clock import utcnow
from tinkerd.control import projects
from tinkerd.errors import UserError

router = APIRouter(prefix="/api/v1", dependencies=[Depends(authenticate)])

MAX_WINDOW = timedelta(days=14)


def _hour(name: str, value: str) -> datetime:
    """An RFC 3339 timestamp aligned to a UTC hour, as naive UTC (how the store keeps times)."""
    try:
        dt = datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError as e:
        raise UserError(f"{name} must be an RFC 3339 timestamp such as 2026-07-13T00:00:00Z, got {value!r}") from e
    if dt.tzinfo is not None:
        dt = dt.astimezone(timezone.utc).replace(tzinfo=None)
    if (dt.minute, dt.second, dt.microsecond) != (0, 0, 0):
        raise UserError(f"{name} must be aligned to a UTC hour boundary, got {value!r}")
    return dt


@router.get("/billing/usage/events")
def billing_usage_events(request: Request, starting_on: str, ending_before: str) -> dict:
    start, end = _hour("starting_on", starting_on), _hour("ending_before", ending_before)
    if end <= start:
        raise UserError("ending_before must be after starting_on")
    if end - start > MAX_WINDOW:
        raise UserError("the window may span at most 14 days")
    if start > utcnow():
        raise UserError("starting_on must not be in the future")
    st = state(request)
    account_id = account(request)
    names = {account_id: st.accounts.account_name(account_id)}
    data = []
    now = utcnow()
    st.runs.storage.sync(now)
    storage = gb_hour_buckets(st.runs.storage.intervals(account_id, start, end), start, end, now)
    # Ordered by bucket, then descending quantity (the SDK's order), storage after tokens of its hour.
    buckets = sorted(hourly_buckets(st.control.meter.rows(account_id, start, end)) + storage,
                     key=lambda b: (b.start, b.kind == STORAGE_KIND, -b.quantity, b.kind))
    for b in buckets:
        event = {"bucket_start": iso(b.start), "bucket_end": iso(bucket_end(b)), "base_model": b.base_model,
                 "user_id": b.account_id, "user_name": names.get(b.account_id), "session_id": b.session_id,
                 "project_id": None, "estimated_cost_usd": None, "effective_rate_usd_per_million_tokens": None,
                 "effective_rate_usd_per_gigabyte_month": None}
        if b.kind in TOKEN_KINDS:
            rate = st.config.token_price_usd_per_mtok(b.kind)
            event.update(estimated_cost_usd=rate * b.quantity / 1e6, effective_rate_usd_per_million_tokens=rate)
            info = {"type": TOKEN_KINDS[b.kind], "token_count": b.quantity}
            if b.kind == "prefill_tokens":
                info["cached"] = False  # tinkerd has no prefill cache
        elif b.kind == STORAGE_KIND:
            rate = st.config.price_storage_usd_per_gb_month
            event.update(estimated_cost_usd=storage_cost_usd(b.quantity, rate), effective_rate_usd_per_gigabyte_month=rate)
            info = {"type": "storage", "gigabyte_hours": b.quantity, "free": False}
        else:
            info = {"type": "checkpoint", "count": b.quantity}
        data.append(event | {"event_info": info})
    session_ids = {e["session_id"] for e in data if e["session_id"]}
    sessions = {}
    if session_ids:
        for row in st.runs.sessions.by_ids(session_ids):
            sessions[row.session_id] = {"user_metadata": {str(k): str(v) for k, v in (row.user_metadata or {}).items()} or None}
            for e in data:
                if e["session_id"] == row.session_id:
                    e["project_id"] = row.project_id  # the session's project now (usage follows a moved session)
    return {"data": data, "sessions": sessions, "cost_data_through": None}


@router.get("/billing/usage/checkpoints/current")
def current_checkpoint_storage(request: Request, project_id: str | None = None) -> dict:
    """The caller's live checkpoints grouped by project (one owner: the account), or one project's."""
    st = state(request)
    account_id = account(request)
    if project_id is not None:
        projects.require(st.control.store, account_id, [project_id])
    rows, _ = st.runs.checkpoints.list_checkpoints(account_id=account_id, project_id=project_id)
    project_of = st.runs.sessions.projects_of_runs({r.model_id for r in rows})
    groups: dict[str | None, list] = {}
    for r in rows:
        groups.setdefault(project_of.get(r.model_id), []).append(r)
    rate = st.config.price_storage_usd_per_gb_month
    name = st.accounts.account_name(account_id)
    data = []
    for pid, group in sorted(groups.items(), key=lambda g: (g[0] is not None, g[0] or "")):
        size = sum(r.size_bytes or 0 for r in group)
        data.append({"project_id": pid, "org_user_urn": account_id, "user_email": None,
                     "user_name": name, "checkpoint_count": len(group), "size_bytes": size,
                     "size_gigabytes": size / BYTES_PER_GB, "estimated_monthly_cost_usd": rate * size / BYTES_PER_GB})
    return {"effective_rate_usd_per_gigabyte_month": rate, "data": data}

