"""Request-scoped helpers: the app's shared state, authentication, body parsing."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TypeVar

import pydantic
import zstandard
from fastapi import Request
from fastapi.responses import JSONResponse, Response

from tinkerd.api.compat import validate_lenient
from tinkerd.config import ServerConfig
from tinkerd.control.accounts import Accounts
from tinkerd.control.control import Control, Work
from tinkerd.control.runs import Runs
from tinkerd.errors import TinkerdError, UserError
from tinkerd.types import ServedModel

M = TypeVar("M", bound=pydantic.BaseModel)


@dataclass
class AppState:
    config: ServerConfig
    control: Control
    runs: Runs
    served: dict[str, ServedModel]
    accounts: Accounts

    def served_model(self, name: str) -> ServedModel:
        model = self.served.get(name)
        if model is None:
            raise UserError(f"base model {name!r} is not served here; served: {sorted(self.served)}")
        return model


class AuthError(TinkerdError):
    category = "user"
    status_code = 401


def state(request: Request) -> AppState:
    return request.app.state.tinkerd


def authenticate(request: Request) -> None:
    key = request.headers.get("x-api-key")
    if not key:
        raise AuthError("missing X-API-Key header")
    account_id = state(request).accounts.verify(key)
    if account_id is None:
        raise AuthError("invalid or revoked API key")
    request.state.account_id = account_id


def account(request: Request) -> str:
    """The authenticated caller's account (routes run behind `authenticate`)."""
    return request.state.account_id


async def read_body(request: Request) -> bytes:
    """The request body, zstd-decoded when the SDK compressed it, within the configured size limit."""
    limit = state(request).config.max_body_bytes
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise PayloadTooLarge(f"request body of {declared} bytes is over the {limit}-byte limit")
    body = bytearray()
    async for part in request.stream():
        body.extend(part)
        if len(body) > limit:
            raise PayloadTooLarge(f"request body is over the {limit}-byte limit")
    if request.headers.get("content-encoding", "").lower() == "zstd":
        return _unzstd(bytes(body), limit)
    return bytes(body)


def _unzstd(body: bytes, limit: int) -> bytes:
    """Stream-decompress, stopping as soon as the output passes `limit`: a zstd bomb costs us at
    most `limit` bytes of memory, whatever its frame header claims."""
    out = bytearray()
    try:
        with zstandard.ZstdDecompressor().stream_reader(body) as reader:
            while chunk := reader.read(1 << 20):
                out.extend(chunk)
                if len(out) > limit:
                    raise PayloadTooLarge(f"decompressed request body is over the {limit}-byte limit")
    except zstandard.ZstdError as e:
        raise UserError(f"cannot decompress zstd body: {e}") from e
    return bytes(out)


class PayloadTooLarge(UserError):
    status_code = 413


def parse(model: type[M], body: bytes) -> M:
    return parse_ignoring_unknown(model, body)[0]


def parse_ignoring_unknown(model: type[M], body: bytes) -> tuple[M, list[str]]:
    """The request, and the paths of fields it carried that the schema does not know (api/compat.py)."""
    try:
        return validate_lenient(model, body)
    except pydantic.ValidationError as e:
        problems = "; ".join(f"{'.'.join(str(p) for p in err['loc']) or 'body'}: {err['msg']}" for err in e.errors()[:5])
        raise UserError(f"invalid {model.__name__}: {problems}") from e


def json_bytes(obj: dict) -> tuple[bytes, str]:
    return json.dumps(obj).encode(), "application/json"


def error_response(e: TinkerdError) -> JSONResponse:
    # `headers`: Retry-After of a 503 StorageUnavailable (errors.py); other errors have none.
    return JSONResponse({"error": e.message, "category": e.category}, status_code=e.status_code,
                        headers=getattr(e, "headers", None))


def future_response(request_id: str, **extra) -> JSONResponse:
    return JSONResponse({"request_id": request_id, **extra})


@dataclass
class Prepared:
    """A validated request ready for the queue: what `Control.submit` needs, built from the body alone
    (plus stored state), so recovery can rebuild it from the write-ahead log."""

    request_type: str
    target: str
    seq_id: int | None
    work: Work
    response: dict | None = None  # extra fields of the future response (e.g. sample_sequence_ids)


def submit(st: AppState, prepared: Prepared, body: bytes, account_id: str) -> JSONResponse:
    accepted = st.control.submit(prepared.request_type, prepared.target, prepared.seq_id, body, prepared.work,
                                 account_id=account_id)
    st.runs.touch(prepared.target)  # a training run's last_request_time; no-op for other targets
    return future_response(accepted.request_id, model_id=prepared.target, **(prepared.response or {}))


def empty() -> Response:
    return Response(status_code=204)
