"""retrieve_future: a long poll that answers when the result is ready or the hold time passes;
retrieve_futures: the same for all of one sampling-session client's requests (control/completions.py);
cancel_future: stop a sampling request its client gave up on.

The two long polls stay coroutines, so a held poll costs no thread (32 clients hold 32 polls at
once; the thread pool has 40). Their store reads and the result's encoding run in the thread pool
(`run_in_threadpool`), never on the event loop, which every other client's request waits on.
"""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool
from tinker import types as t

from tinkerd.api import hpcai, limits
from tinkerd.api.deps import account, authenticate, empty, load_json, parse, read_body, state
from tinkerd.api.results import wire_result
from tinkerd.control.completions import CLONE_BLOCK, MAX_CURSOR, completions
from tinkerd.control.quotas import PAUSED
from tinkerd.control.records import Future
from tinkerd.errors import NotFoundError, UserError

router = APIRouter(prefix="/api/v1", dependencies=[Depends(authenticate)])


def _owned_future(st, request_id: str, account_id: str) -> Future:
    row = st.control.futures.get(request_id)
    # Another account's request id answers exactly like an unknown one.
    if row is None or (row.account_id is not None and row.account_id != account_id):
        raise NotFoundError(f"unknown request_id {request_id!r}")
    return row


@router.post("/retrieve_future")
async def retrieve_future(request: Request, body: bytes = Depends(read_body)) -> Response:
    st = state(request)
    req = parse(t.FutureRetrieveRequest, hpcai.retrieve_body(body))
    owned = await run_in_threadpool(_owned_future, st, req.request_id, account(request))
    row = await st.control.retrieve(req.request_id, st.config.retrieve_future_timeout_s, owned)
    return await run_in_threadpool(_answer, st, request, req.request_id, row)


def _answer(st, request: Request, request_id: str, row: Future | None) -> Response:
    if row is None:
        raise NotFoundError(f"unknown request_id {request_id!r}")
    if row.expired_at is not None:  # only its owner gets here: see control/retention.py for the 404
        raise NotFoundError(st.control.expired_message(row.request_id))
    if row.status == "pending":
        # Only after the long-poll hold. The try_again body goes out as a 408: the SDK (0.36 and 0.38,
        # api_future_impl) re-polls a 408 at once and quietly, reading queue_state from its body,
        # while a 200 try_again logs "Retrying request ... because of try_again" at WARNING on every
        # hold of a long op. An op its account's quota holds back is "paused_rate_limit" (why:
        # control/quotas.py); the SDK keeps polling either way.
        body = {"type": "try_again", "request_id": row.request_id, "queue_state": "active"}
        reason = st.control.pause_reason(row.request_id)
        if reason is not None:
            body.update(queue_state=PAUSED, queue_state_reason=reason)
        return JSONResponse(body, status_code=408)
    if row.status == "failed":
        return JSONResponse({"error": row.error, "category": row.error_category or "unknown"})
    body, media_type = wire_result(row.request_type, row.result, row.result_media_type, row.body,
                                   as_json=hpcai.wants_json(request), hpcai_paths=hpcai.is_hpcai(request))
    return Response(body, media_type=media_type)


@router.post("/retrieve_futures")
async def retrieve_futures(request: Request, body: bytes = Depends(read_body)) -> dict:
    """The finished requests of one sampling-session client (the SDK's SessionFuturesPoller) after
    its cursor, held up to the long-poll time (or `timeout`, 0: answer at once) while there are none.
    `retrieved_request_ids` needs nothing here: fetching a result already started its retention."""
    st = state(request)
    req = parse(t.FuturesRetrieveRequest, body)
    target = req.target.sampling_session_id
    # another account's: 404 as an unknown one
    await run_in_threadpool(st.runs.sampling_sessions.owned_sampling_session, target, account(request))
    limits.integer(req.target.cloned_sampler_id, "target.cloned_sampler_id", hi=limits.INT64_MAX // CLONE_BLOCK)
    limits.integer(req.prev_cursor, "prev_cursor", hi=MAX_CURSOR)
    hold = st.config.retrieve_future_timeout_s
    if req.timeout is not None:
        limits.real(req.timeout, "timeout", 0.0)
        hold = min(hold, req.timeout)
    clone, cursor = req.target.cloned_sampler_id, req.prev_cursor
    found, next_cursor = await run_in_threadpool(completions, st.control.store, target, clone, cursor)
    if not found and hold > 0:
        await st.control.hub.wait(f"target:{target}", hold, lambda: run_in_threadpool(
            lambda: bool(completions(st.control.store, target, clone, cursor)[0])))
        # Read again: a wake-up means a completion of the session was stored after the last check
        # (answering from that check's empty read sent the client back with nothing, a round trip
        # lost; test_sdk_futures' clone-3 poll failed so under load).
        found, next_cursor = await run_in_threadpool(completions, st.control.store, target, clone, cursor)
    return {
        "completions": [
            {"state": "finished", "request_id": c.request_id, "response_payload_uncompressed_size": c.payload_bytes}
            if c.finished else {"state": "failed", "request_id": c.request_id}
            for c in found
        ],
        "cursor": next_cursor,
    }


@router.post("/cancel_future")
def cancel_future(request: Request, body: bytes = Depends(read_body)) -> Response:
    """Stop a sampling request (the SDK sends this when a sample's future is abandoned: a timeout or
    a cancel, with `sample_cancel_enabled`). 204 whether it was stopped or had already finished."""
    st = state(request)
    body = load_json(body)
    request_id = body.get("request_id") if isinstance(body, dict) else None
    if not isinstance(request_id, str) or not request_id:
        raise UserError("cancel_future needs a request_id (a string)")
    st.control.cancel(_owned_future(st, request_id, account(request)))
    return empty()
