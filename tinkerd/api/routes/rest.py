"""RestClient endpoints: training runs, checkpoints (list, delete, TTL, publish) and weights_info.

Path parameters arrive unencoded: run ids contain ':' (`sess-…:train:0`) and a checkpoint id is
`<type segment>/<name>`, so routes spell both parts out. Anything else under a run's checkpoints
(a name with '/', a wrong segment, a '..' name that HTTP clients normalise away) lands on the
catch-all at the end with a 404 that says what a checkpoint id looks like — this router must be
registered after every other router with routes under /training_runs.

Responses carry every field the SDK's strict models require (TrainingRun.model_owner,
last_request_time, TrainingRunsResponse.cursor, …); datetimes are ISO-8601 with a 'Z'.
"""

from __future__ import annotations


from fastapi import APIRouter, Depends, Request, Response

from tinkerd.api import hpcai, limits
from tinkerd.api.deps import account, authenticate, empty, load_json, read_body, state
from tinkerd.control import projects
from tinkerd.control.ids import LOCAL_OWNER, TYPE_SEGMENTS, TinkerPath, check_name, iso, parse_tinker_path
from tinkerd.control.runs import Runs
from tinkerd.control.records import Checkpoint, TrainingRun
from tinkerd.errors import NotFoundError, UserError

router = APIRouter(prefix="/api/v1", dependencies=[Depends(authenticate)])

# Both scopes list the caller's own runs: tinkerd has no sharing of runs between accounts (published
# checkpoints are loadable by path, not listed).
ACCESS_SCOPES = ("owned", "accessible")
# The SDK CLI pages checkpoints 1000 at a time; a bound keeps one request's response small.
MAX_PAGE = 10_000


def checkpoint_json(row: Checkpoint, base_model: str | None = None) -> dict:
    segment = TYPE_SEGMENTS[row.checkpoint_type]
    return {
        # Not a field of SDK 0.38's Checkpoint (its models ignore extra keys): newer SDKs and the
        # console read which base model a checkpoint's weights apply to without a second lookup.
        "base_model": base_model,
        "checkpoint_id": f"{segment}/{row.name}",
        "checkpoint_type": row.checkpoint_type,
        "time": iso(row.created_at),
        "tinker_path": row.tinker_path,
        # What the hpcai client requires (api/hpcai.py turns it into an hpcai:// path for that client).
        "checkpoint_path": row.tinker_path,
        "size_bytes": row.size_bytes,
        "public": bool(row.public),
        "user_metadata": dict(row.user_metadata or {}),
        "expires_at": iso(row.expires_at),
    }


def run_json(runs: Runs, row: TrainingRun) -> dict:
    last = runs.checkpoints.last_checkpoint(row.model_id, "training")
    last_sampler = runs.checkpoints.last_checkpoint(row.model_id, "sampler")
    return {
        "training_run_id": row.model_id,
        "base_model": row.base_model,
        "model_owner": runs.sessions.account_of(row.session_id) or LOCAL_OWNER,
        "is_lora": True,
        "corrupted": False,
        "lora_rank": row.lora_rank,
        "last_request_time": iso(row.last_request_at),
        "last_checkpoint": checkpoint_json(last, row.base_model) if last else None,
        "last_sampler_checkpoint": checkpoint_json(last_sampler, row.base_model) if last_sampler else None,
        "user_metadata": dict(row.user_metadata or {}),
    }


def _page(limit: int, offset: int) -> tuple[int, int]:
    if not 0 <= limit <= MAX_PAGE:
        raise UserError(f"limit must be between 0 and {MAX_PAGE}, got {limit}")
    limits.integer(offset, "offset")  # an SQLite OFFSET is int64: 2^63 was a 500
    return limit, offset


def _scope(access_scope: str) -> None:
    if access_scope not in ACCESS_SCOPES:
        raise UserError(f"access_scope must be one of {list(ACCESS_SCOPES)}, got {access_scope!r}")


def _path(run_id: str, type_seg: str, name: str) -> TinkerPath:
    return parse_tinker_path(f"tinker://{run_id}/{type_seg}/{check_name(name)}")


# -- training runs ------------------------------------------------------------------------------


@router.get("/training_runs")
def list_training_runs(request: Request, limit: int = 20, offset: int = 0, access_scope: str = "owned",
                             project_id: str | None = None) -> dict:
    _scope(access_scope)
    limit, offset = _page(limit, offset)
    runs = state(request).runs
    if project_id is not None:  # one of the caller's projects (control/projects.py); others are 404
        projects.require(runs.store, account(request), [project_id])
    rows, total = runs.training_runs.list_runs(limit, offset, account_id=account(request), project_id=project_id)
    return hpcai.rest_answer(request, {
        "training_runs": [run_json(runs, r) for r in rows],
        "cursor": {"offset": offset, "limit": limit, "total_count": total},
    })


@router.get("/training_runs/{run_id}")
def get_training_run(run_id: str, request: Request, access_scope: str = "owned") -> dict:
    _scope(access_scope)
    runs = state(request).runs
    return hpcai.rest_answer(request, run_json(runs, runs.training_runs.owned_run(run_id, account(request))))


# -- checkpoints --------------------------------------------------------------------------------


@router.get("/training_runs/{run_id}/checkpoints")
def list_run_checkpoints(run_id: str, request: Request) -> dict:
    runs = state(request).runs
    run = runs.training_runs.owned_run(run_id, account(request))
    rows, total = runs.checkpoints.list_checkpoints(run_id)
    return hpcai.rest_answer(request, {"checkpoints": [checkpoint_json(r, run.base_model) for r in rows],
                                       "cursor": {"offset": 0, "limit": total, "total_count": total}})


@router.get("/checkpoints")
def list_user_checkpoints(request: Request, limit: int = 100, offset: int = 0) -> dict:
    limit, offset = _page(limit, offset)
    runs = state(request).runs
    rows, total = runs.checkpoints.list_checkpoints(limit=limit, offset=offset, account_id=account(request))
    bases = runs.training_runs.base_models(r.model_id for r in rows)
    return hpcai.rest_answer(request, {
        "checkpoints": [checkpoint_json(r, bases.get(r.model_id)) for r in rows],
        "cursor": {"offset": offset, "limit": limit, "total_count": total},
    })


@router.delete("/training_runs/{run_id}/checkpoints/{type_seg}/{name}/publish")
def unpublish_checkpoint(run_id: str, type_seg: str, name: str, request: Request) -> Response:
    state(request).runs.checkpoints.set_public(_path(run_id, type_seg, name), False, account(request))
    return empty()


@router.post("/training_runs/{run_id}/checkpoints/{type_seg}/{name}/publish")
def publish_checkpoint(run_id: str, type_seg: str, name: str, request: Request) -> Response:
    # The SDK posts an empty body with a JSON content type: nothing to parse.
    state(request).runs.checkpoints.set_public(_path(run_id, type_seg, name), True, account(request))
    return empty()


@router.put("/training_runs/{run_id}/checkpoints/{type_seg}/{name}/ttl")
def set_checkpoint_ttl(run_id: str, type_seg: str, name: str, request: Request, body: bytes = Depends(read_body)) -> dict:
    path = _path(run_id, type_seg, name)
    body = load_json(body)
    if not isinstance(body, dict) or "ttl_seconds" not in body:
        raise UserError('send {"ttl_seconds": <seconds> or null}')
    runs = state(request).runs
    row = runs.checkpoints.set_ttl(path, body["ttl_seconds"], account(request))
    return hpcai.rest_answer(request, checkpoint_json(row, runs.training_runs.base_models([row.model_id]).get(row.model_id)))


@router.delete("/training_runs/{run_id}/checkpoints/{type_seg}/{name}")
def delete_checkpoint(run_id: str, type_seg: str, name: str, request: Request) -> Response:
    state(request).runs.checkpoints.delete_checkpoint(_path(run_id, type_seg, name), account(request))
    return empty()


@router.post("/weights_info")
def weights_info(request: Request, body: bytes = Depends(read_body)) -> dict:
    body = load_json(body)
    tinker_path = body.get("tinker_path") if isinstance(body, dict) else None
    if not isinstance(tinker_path, str):
        raise UserError('send {"tinker_path": "tinker://<run_id>/<type>/<name>"}')
    runs = state(request).runs
    ckpt = runs.checkpoints.owned_checkpoint(hpcai.parse_path(tinker_path), account(request), public_ok=True)
    run = runs.training_runs.run(ckpt.model_id)
    cfg = run.lora_config or {}
    return {
        "base_model": run.base_model,
        "is_lora": True,
        "lora_rank": run.lora_rank,
        "train_unembed": bool(cfg.get("train_unembed", True)),
        "train_mlp": bool(cfg.get("train_mlp", True)),
        "train_attn": bool(cfg.get("train_attn", True)),
        "optimizer_config": {"type": "adamw"},
    }


# -- the catch-all (keep last) ------------------------------------------------------------------


@router.api_route("/training_runs/{run_id}/checkpoints", methods=["POST", "PUT", "DELETE"])
@router.api_route("/training_runs/{run_id}/checkpoints/{rest:path}", methods=["GET", "POST", "PUT", "DELETE"])
async def no_such_checkpoint_endpoint(request: Request) -> Response:
    raise NotFoundError(
        f"{request.method} {request.url.path}: no such checkpoint endpoint. A checkpoint id is "
        "<weights|sampler_weights|external_weights>/<name>, and a name is 1-128 letters, digits, "
        "'.', '_' or '-' (no '/', not '.' or '..')"
    )
