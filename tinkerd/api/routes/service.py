"""Client configuration, sessions, heartbeat, telemetry, capabilities."""

from __future__ import annotations

import json

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse
from tinker import types as t

from tinkerd.api.compat import session_warning
from tinkerd.api.deps import account, authenticate, check_json_depth, empty, parse, parse_ignoring_unknown, read_body, state
from tinkerd.control.projects import check_project_id
from tinkerd.errors import StorageUnavailable

router = APIRouter(prefix="/api/v1")
authed = APIRouter(prefix="/api/v1", dependencies=[Depends(authenticate)])


@router.get("/healthz")
async def healthz() -> dict:
    return {"status": "ok"}


@router.get("/readyz")
def readyz(request: Request) -> JSONResponse:
    """Whether this server should get new work, for a load balancer: 200 when it should, 503 (with
    Retry-After) when storage is under its reserve or not writable, a result waits on storage, or
    the engine is restarting or down. Unauthenticated like healthz; it names no runs or accounts.
    A plain def: FastAPI runs it on a thread, as the store probe may wait its 0.1 s busy timeout."""
    health = state(request).control.health()
    body = {"status": "ok" if health["ready"] else "unavailable", **health}
    if health["ready"]:
        return JSONResponse(body)
    return JSONResponse(body, status_code=503, headers={"Retry-After": str(StorageUnavailable.retry_after_s)})


@authed.post("/client/config")
def client_config(request: Request) -> dict:
    return {
        # Serial chunk submission keeps every model's ops in seq_id order on arrival, so gradient
        # accumulation sums in one fixed order and resumed runs reproduce bit-for-bit.
        "parallel_fwdbwd_chunks": False,
        # The SDK trades its key for a JWT (POST /api/v1/auth/token) and sends that: whoami reads it.
        "pjwt_auth_enabled": state(request).tokens is not None,
        "sample_max_concurrent_requests": 64,
        "proto_compress_fwdbwd": False,
        # create_custom_loss uploads the traced loss and forward_backward_custom runs it here in one
        # pass (api/routes/custom_loss.py, engine/losses/custom.py).
        "custom_loss_server_side": True,
        # One retrieve_futures long poll per sampling client instead of one retrieve_future per
        # in-flight sample (routes/futures.py), and server-allocated clone ids for unpickled clients.
        "sample_use_retrieve_futures": True,
        "sample_join_sampling_session": True,
        # httpx's own transport, not the SDK's default pyqwest (tokio) one: a tokio worker that is
        # inside a call into Python when the client's interpreter exits is killed by pthread_exit
        # unwinding through Rust frames, and the client aborts (-6) after finishing its work. With
        # retrieve_futures a long poll is in flight at every exit: 1-2 in 15-30 runs of a short
        # SDK script aborted in a fresh venv; 0 in 40 with this (docs/compatibility.md: the gdb stack).
        "use_pyqwest_transport": False,
    }


@authed.post("/client/dynamic_config")
async def dynamic_config() -> dict:
    # An abandoned sample (a timeout, a cancel) is stopped in the engine at once (cancel_future).
    return {"sample_cancel_enabled": True}


@authed.post("/create_session")
def create_session(request: Request, body: bytes = Depends(read_body)) -> dict:
    req, ignored = parse_ignoring_unknown(t.CreateSessionRequest, body)
    project_id = check_project_id(req.project_id) if req.project_id is not None else None
    session_id = state(request).runs.sessions.create_session(req.tags, req.user_metadata or {}, req.sdk_version,
                                                    account(request), getattr(req, "display_name", None), project_id)
    answer = {"session_id": session_id, "type": "create_session"}
    warning = session_warning(req.sdk_version, ignored)
    if warning:
        answer["warning_message"] = warning
    return answer


@authed.post("/session_heartbeat")
def session_heartbeat(request: Request, body: bytes = Depends(read_body)) -> dict:
    req = parse(t.SessionHeartbeatRequest, body)
    state(request).runs.sessions.heartbeat(req.session_id, account(request))
    return {"type": "session_heartbeat"}


@authed.post("/sessions/{session_id}/finish")
def finish_session(session_id: str, request: Request, body: bytes = Depends(read_body)):
    reason = None
    check_json_depth(body)  # deeper JSON was a RecursionError, a 500 the SDK retries
    try:
        reason = (json.loads(body or b"{}").get("reason") or {}).get("type")
    except (ValueError, AttributeError):
        pass  # no reason, or one of another shape: the session still finishes
    st = state(request)
    st.runs.sessions.finish_session(session_id, reason, account(request))
    st.control.release_run()  # release its runs now: their quota places come free
    return empty()


@authed.post("/telemetry")
async def telemetry() -> dict:
    # Accepted and dropped: tinkerd keeps its own metrics; the literal is required by the SDK.
    return {"status": "accepted"}


@authed.get("/get_server_capabilities")
def get_server_capabilities(request: Request) -> JSONResponse:
    served = state(request).served.values()
    models = [
        {"model_name": m.name, "max_context_length": m.max_context_length, "trainable": True, "sampleable": True}
        for m in served
        if not m.unavailable  # asked for and refused at start (engine/model/families.py): not served
    ]
    # Not a field of the SDK's GetServerCapabilitiesResponse: its pydantic model ignores extra keys,
    # so SDK callers never see it, but plain HTTP clients (curl, scripts) can read which loss_fn
    # names forward_backward accepts. Unsupported names fail with a user error listing the same set.
    loss_fns = sorted({name for m in served for name in m.loss_fns})
    return JSONResponse({"supported_models": models, "supported_loss_fns": loss_fns})


@authed.get("/engine_status")
def engine_status(request: Request) -> dict:
    """Not in the Tinker protocol (the SDK never calls it): what the engine holds after its last step,
    as counts over all accounts (no ids), and which of the caller's runs are released from it
    (their session stopped heart-beating; the next op rebuilds them)."""
    residency = state(request).control.residency
    resident = residency.resident if residency is not None else None
    return {
        "training_adapters": resident.training if resident is not None else None,
        "sampler_adapters": len(resident.sampler_paths) if resident is not None else None,
        "released_model_ids": residency.unloaded_runs_of(account(request)) if residency is not None else [],
    }
