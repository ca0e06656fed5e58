"""retrieve_future: a long poll that answers when the result is ready or the hold time passes."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response
from tinker import types as t

from tinkerd.api.deps import account, authenticate, parse, read_body, state
from tinkerd.api.results import wire_result
from tinkerd.control.quotas import PAUSED
from tinkerd.control.store.tables import FutureRow
from tinkerd.errors import NotFoundError

router = APIRouter(prefix="/api/v1", dependencies=[Depends(authenticate)])


@router.post("/retrieve_future")
async def retrieve_future(request: Request) -> Response:
    st = state(request)
    req = parse(t.FutureRetrieveRequest, await read_body(request))
    owner = st.control.store.get(FutureRow, req.request_id)
    # Another account's request id answers exactly like an unknown one.
    if owner is None or (owner.account_id is not None and owner.account_id != account(request)):
        raise NotFoundError(f"unknown request_id {req.request_id!r}")
    row = await st.control.retrieve(req.request_id, st.config.retrieve_future_timeout_s)
    if row is None:
        raise NotFoundError(f"unknown request_id {req.request_id!r}")
    if row.expired_at is not None:  # only its owner gets here: see control/retention.py for the 404
        raise NotFoundError(st.control.expired_message(row.request_id))
    if row.status == "pending":
        # Only after the long-poll hold. The try_again body goes out as a 408: the SDK (0.36 and 0.38,
        # api_future_impl) re-polls a 408 at once and quietly, reading queue_state from its body,
        # while a 200 try_again logs "Retrying request ... because of try_again" at WARNING on every
        # hold of a long op. An op its account's quota holds back is "paused_rate_limit" (why:
        # control/quotas.py); the SDK keeps polling either way.
        body = {"type": "try_again", "request_id": row.request_id, "queue_state": "active"}
        reason = st.control.scheduler.pause_reason(row.request_id)
        if reason is not None:
            body.update(queue_state=PAUSED, queue_state_reason=reason)
        return JSONResponse(body, status_code=408)
    if row.status == "failed":
        return JSONResponse({"error": row.error, "category": row.error_category or "unknown"})
    body, media_type = wire_result(row.request_type, row.result, row.result_media_type)
    return Response(body, media_type=media_type)
