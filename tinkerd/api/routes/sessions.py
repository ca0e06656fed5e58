"""RestClient sessions (list, get, search, assign project) and copy_weights.

Every caller sees its own account's sessions only; another account's session id answers 404
exactly like a missing one. `access_scope=accessible` is the same as `owned` (tinkerd shares no
sessions between accounts). Projects are the account's own (control/projects.py): a project filter
naming one the account has no session in is a 404; assigning a session to a new name creates it.
"""

from __future__ import annotations

from datetime import timezone

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response
from tinker import types as t

from tinkerd.api import hpcai, limits
from tinkerd.api.deps import account, authenticate, empty, load_json, parse, read_body, state
from tinkerd.control import projects
from tinkerd.control.projects import check_project_id
from tinkerd.control.copies import copy_weights
from tinkerd.control.ids import LOCAL_OWNER, iso
from tinkerd.control.sessions import SessionSearch, Sessions, status_of
from tinkerd.control.tokens import InvalidToken
from tinkerd.control.traces import session_trace
from tinkerd.errors import LinkRefused, UserError

router = APIRouter(prefix="/api/v1", dependencies=[Depends(authenticate)])
# The signed trace download: the URL is the credential (the SDK and CLI fetch it with no headers).
public = APIRouter(prefix="/api/v1")
TRACE_AUDIENCE = "trace_export"
TRACE_LINK_S = 3600  # the SDK says its URL "expires after about an hour"

ACCESS_SCOPES = ("owned", "accessible")
MAX_PAGE = 10_000


def _sessions(request: Request) -> Sessions:
    return state(request).runs.sessions


def _scope(access_scope: str) -> None:
    if access_scope not in ACCESS_SCOPES:
        raise UserError(f"access_scope must be one of {list(ACCESS_SCOPES)}, got {access_scope!r}")


@router.get("/sessions")
def list_sessions(request: Request, limit: int = 20, offset: int = 0, access_scope: str = "owned") -> dict:
    _scope(access_scope)
    if not 0 <= limit <= MAX_PAGE:
        raise UserError(f"limit must be between 0 and {MAX_PAGE}, got {limit}")
    limits.integer(offset, "offset")
    return {"sessions": _sessions(request).list(account(request), limit, offset)}


@router.post("/sessions/search")
def search_sessions(request: Request, body: bytes = Depends(read_body)) -> dict:
    req = parse(t.SessionSearchRequest, body)
    if req.project_ids is not None:
        projects.require(state(request).runs.store, account(request), list(req.project_ids), "project_ids")
    if req.owner.type == "user":
        raise UserError("tinkerd shares no sessions between accounts: search your own (owner type 'own')")
    after = None
    if req.cursor is not None:
        at = req.cursor.last_created_at.astimezone(timezone.utc).replace(tzinfo=None)
        after = (at, req.cursor.last_session_id)
    q = SessionSearch(session_id=req.session_id, display_name=req.display_name, user_metadata=dict(req.user_metadata),
                      statuses=[s.model_dump() for s in req.statuses] if req.statuses else None, limit=req.limit,
                      after=after, project_ids=list(req.project_ids) if req.project_ids is not None else None)
    sessions = _sessions(request)
    rows, more = sessions.search(account(request), q)
    totals = sessions.checkpoint_totals([r.session_id for r in rows])
    page = [{
        "session_id": r.session_id, "created_at": iso(r.created_at), "owner": r.account_id or LOCAL_OWNER,
        "project_id": r.project_id or "",  # a str in SessionSummary: "" for a session in no project
        "status": status_of(r), "checkpoints_count": totals.get(r.session_id, (0, 0))[0],
        "display_name": r.display_name, "user_metadata": {str(k): str(v) for k, v in (r.user_metadata or {}).items()},
        "checkpoint_storage_bytes": totals.get(r.session_id, (0, 0))[1],
    } for r in rows]
    cursor = None
    if more and rows:
        cursor = {"last_created_at": iso(rows[-1].created_at), "last_session_id": rows[-1].session_id}
    return {"sessions": page, "next_cursor": cursor}


@router.get("/sessions/{session_id}")
def get_session(session_id: str, request: Request, access_scope: str = "owned") -> dict:
    _scope(access_scope)
    row, runs, samplers = _sessions(request).get(session_id, account(request))
    return {"training_run_ids": runs, "sampler_ids": samplers,
            "user_metadata": {str(k): str(v) for k, v in (row.user_metadata or {}).items()},
            "display_name": row.display_name}


@router.get("/sessions/{session_id}/trace_export")
def trace_export(session_id: str, request: Request) -> dict:
    """Ready at once: the trace is built from the store when the signed URL is fetched, so it is
    always up to date (control/traces.py)."""
    st = state(request)
    row = st.runs.sessions.owned_session(session_id, account(request))
    token = st.tokens.sign_url_token(TRACE_AUDIENCE, {"session_id": row.session_id}, TRACE_LINK_S)
    return {"status": "ready", "url": f"{str(request.base_url).rstrip('/')}/api/v1/trace_downloads/{token}"}


@public.get("/trace_downloads/{token}")
def trace_download(token: str, request: Request) -> JSONResponse:
    st = state(request)
    try:
        claims = st.tokens.verify_url_token(token, TRACE_AUDIENCE)
    except InvalidToken as e:
        raise LinkRefused(f"{e.args[0]}: export the trace again for a new link") from None
    session_id = claims.get("session_id")
    if not isinstance(session_id, str):
        raise LinkRefused("invalid link: export the trace again for a new link")
    trace = session_trace(st.runs.store, session_id)
    return JSONResponse(trace, headers={"Content-Disposition": f'attachment; filename="{session_id}.pftrace"'})


@router.put("/sessions/{session_id}/project")
def assign_session_project(session_id: str, request: Request, body: bytes = Depends(read_body)) -> Response:
    runs = state(request).runs
    runs.sessions.owned_session(session_id, account(request))  # a foreign session is a 404 first
    body = load_json(body)
    project_id = body.get("project_id") if isinstance(body, dict) else None
    if project_id is None:
        raise UserError("assign_session_project needs a project_id (a session cannot leave its project)")
    runs.sessions.set_project(session_id, check_project_id(project_id), account(request))
    return empty()


@router.post("/copy_weights")
def copy_weights_route(request: Request, body: bytes = Depends(read_body)) -> dict:
    req = parse(t.CopyWeightsRequest, body)
    if req.weights_access_token is not None or request.headers.get("x-tinker-weights-access-token"):
        raise UserError("tinkerd has no weights access tokens: the owner publishes a checkpoint to share it")
    if req.model_seq_id is not None:
        limits.integer(req.model_seq_id, "model_seq_id")
    source = hpcai.to_tinker(req.source_path)  # an hpcai:// path names the same checkpoint
    path = copy_weights(state(request).runs, source, account(request), session_id=req.session_id,
                        model_seq_id=req.model_seq_id, project_id=req.destination_project_id,
                        ttl_seconds=req.ttl_seconds, idempotency_key=request.headers.get("x-idempotency-key"))
    return {"tinker_path": str(path)}
