"""Request-scoped helpers: the app's shared state, authentication, body parsing."""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from typing import Any, Callable, TypeVar

import numpy as np
import pydantic
import zstandard
from fastapi import Request
from fastapi.responses import JSONResponse, Response

from tinkerd.api.compat import validate_lenient
from tinkerd.config import ServerConfig
from tinkerd.control.accounts import Accounts
from tinkerd.control.control import Control, Work
from tinkerd.control.runs import Runs
from tinkerd.control.stability import StabilityRecords
from tinkerd.control.tokens import InvalidToken, Tokens, looks_like_jwt
from tinkerd.errors import AuthError, InvalidTokenError, PayloadTooLarge, TinkerdError, UserError
from tinkerd.images import ImageLimits
from tinkerd.types import ServedModel, long_context_id

M = TypeVar("M", bound=pydantic.BaseModel)


@dataclass
class AppState:
    config: ServerConfig
    control: Control
    runs: Runs
    served: dict[str, ServedModel]
    accounts: Accounts
    # Sequences sampled with record_stability_info, for stable_reinforce (control/stability.py).
    records: StabilityRecords | None = None
    # base model name -> its tokenizer (api/openai_text.py: TextTokenizer), for the OpenAI-compatible
    # endpoints; wired by cli/serve.py, which may import transformers (this layer may not).
    tokenizers: Callable[[str], Any] | None = None
    # Signs and checks the JWTs of the SDK's auth exchange (control/tokens.py); None: API keys only.
    tokens: Tokens | None = None

    def image_limits(self) -> ImageLimits:
        return ImageLimits(self.config.max_image_bytes, self.config.max_image_pixels)

    def served_model(self, name: str) -> ServedModel:
        """The served model `name` resolves to. A long-context id `<base>:peft:<tokens>` is its base
        with max_context_length = <tokens> (which must not exceed the base's own); its `name` is the
        base's, which is what engine ops carry."""
        model, limit = self.served.get(name), None
        served = sorted(n for n, m in self.served.items() if not m.unavailable)
        if model is None and ":" in name:
            parsed = long_context_id(name)
            if parsed is None:
                raise UserError(f"model name {name!r} is malformed: a long-context variant is written "
                                f"<base model>:peft:<context tokens>, e.g. {(served or ['Qwen/Qwen3-8B'])[0]}:peft:4096")
            base, limit = parsed
            model = self.served.get(base)
        if model is None or model.unavailable:
            why = f" ({model.unavailable})" if model is not None else ""
            raise UserError(f"base model {name!r} is not served here{why}; served: {served}")
        if limit is not None:
            if not 1 <= limit <= model.max_context_length:
                raise UserError(f"model {name!r} asks for a context length of {limit} tokens; {model.name} "
                                f"supports 1 to {model.max_context_length}")
            model = replace(model, max_context_length=limit)
        return model


def state(request: Request) -> AppState:
    return request.app.state.tinkerd


def authenticate(request: Request) -> None:
    """X-API-Key is an API key, or a JWT this server issued for one (POST /api/v1/auth/token)."""
    key = request.headers.get("x-api-key")
    st = state(request)
    accounts = st.accounts
    if not key:
        accounts.auth_failed(None, _source(request))
        raise AuthError("missing X-API-Key header")
    if st.tokens is not None and looks_like_jwt(key):
        _authenticate_jwt(request, st, key)
        return
    row = accounts.key_row(key)
    if row is None or row.revoked_at is not None:
        accounts.auth_failed(key, _source(request))
        raise AuthError("invalid or revoked API key")
    request.state.account_id = row.account_id
    request.state.key_id = row.key_id


def _authenticate_jwt(request: Request, st: AppState, token: str) -> None:
    # A refused JWT says invalid_token (RFC 6750): the SDK then exchanges its key for a new one and
    # replays the request once, and an exchange refused for a revoked key surfaces to the caller.
    try:
        claims = st.tokens.verify(token)
    except InvalidToken as e:
        st.accounts.audit.auth_failed(_source(request), None, e.args[0])
        raise InvalidTokenError(e.args[0]) from None
    row = st.accounts.key_by_id(claims["key_id"])
    if row is None or row.revoked_at is not None or row.account_id != claims["org_id"]:
        st.accounts.audit.auth_failed(_source(request), row.account_id if row else None, "token of a revoked key",
                                      claims["key_id"])
        raise InvalidTokenError("the API key this token was issued for is revoked")
    request.state.account_id = row.account_id
    request.state.key_id = row.key_id


def _source(request: Request) -> str:
    """Where a request came from, for the audit log: the peer address (tinkerd does not trust
    X-Forwarded-For, which any client can set)."""
    return request.client.host if request.client else "unknown"


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


# The deepest JSON the SDK sends is 5 levels (asample: prompt.chunks[].tokens[], measured on a whole
# SDK session and on the request schemas of tinker.types); 64 leaves 12x room. Deeper, Python's json
# raised RecursionError (a 500) at ~1000 and pydantic's parser stops at 200 with a vague message.
MAX_JSON_DEPTH = 64


def check_json_depth(body: bytes, limit: int = MAX_JSON_DEPTH) -> None:
    """Refuse a JSON body nested deeper than `limit` before any parser recurses into it, without
    parsing: brackets inside strings do not count. Vectorised over the bytes with a few n-byte
    temporaries: 1.5 s for 64 MiB of `[[],[],...]` on 2 shared cores, where json.loads takes 14 s (a
    regex cutting out strings took 16 s on 16M short ones). Invalid JSON is left to the parser."""
    if body.count(b"[") + body.count(b"{") <= limit:
        return  # every real request (a few dozen brackets) stops here, at memchr speed
    if b"\\" in body:
        # JSON pairs backslashes left to right, as replace does; a backslash left over escapes the
        # next byte, so a quote after one does not open or close a string.
        body = body.replace(b"\\\\", b"\0\0")
    data = np.frombuffer(body, np.uint8)
    quote = data == ord('"')
    quote[1:] &= data[:-1] != ord("\\")
    outside = (np.cumsum(quote, dtype=np.uint8) & 1) == 0  # parity of the quotes so far (uint8 wraps: fine)
    folded = data | 0x20  # [ -> {, ] -> }
    if _max_depth(data[((folded == ord("{")) | (folded == ord("}"))) & outside]) > limit:
        raise UserError(f"request JSON is nested more than {limit} levels deep (the limit)")


def _max_depth(brackets: np.ndarray) -> int:
    """The deepest nesting in a uint8 array of only []{} bytes (openers have bit 1 set, closers not):
    a running sum in chunks of 4M, 16 MiB of int32 at a time (a depth fits: the body is < 2 GiB)."""
    steps = ((brackets >> 1) & 1).view(np.int8)
    deepest, level = 0, 0
    for start in range(0, len(steps), 1 << 22):
        chunk = steps[start:start + (1 << 22)]
        running = np.cumsum(chunk * 2 - 1, dtype=np.int32)
        deepest, level = max(deepest, level + int(running.max())), level + int(running[-1])
    return deepest


def load_json(body: bytes) -> Any:
    """A JSON body parsed without a schema (`{}` when empty), depth-checked like `parse`."""
    check_json_depth(body)
    try:
        return json.loads(body or b"{}")
    except ValueError as e:
        raise UserError(f"invalid JSON body: {e}") from e


def parse(model: type[M], body: bytes) -> M:
    return parse_ignoring_unknown(model, body)[0]


def parse_ignoring_unknown(model: type[M], body: bytes) -> tuple[M, list[str]]:
    """The request, and the paths of fields it carried that the schema does not know (api/compat.py)."""
    check_json_depth(body)
    try:
        return validate_lenient(model, body)
    except pydantic.ValidationError as e:
        problems = "; ".join(f"{'.'.join(str(p) for p in err['loc']) or 'body'}: {err['msg']}" for err in e.errors()[:5])
        raise UserError(f"invalid {model.__name__}: {problems}") from e


def json_bytes(obj: dict) -> tuple[bytes, str]:
    return json.dumps(obj).encode(), "application/json"


def error_response(e: TinkerdError) -> JSONResponse:
    # `headers`: Retry-After of a 503 StorageUnavailable or a 429 QueueFull (errors.py); others have none.
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


def name_taken(st: AppState, path, request_type: str, model_id: str, seq_id: int | None,
               account_id: str | None) -> bool:
    """Whether a save to the checkpoint `path` would overwrite another one: it exists and this is not
    a re-send of the save that wrote it (the SDK re-sends when a restart cut its first answer off;
    Control.submit then answers the accepted op's future)."""
    return (st.runs.checkpoints.checkpoint_exists(path)
            and not st.control.accepted_before(request_type, model_id, seq_id, account_id))


def submit(st: AppState, prepared: Prepared, body: bytes, account_id: str,
           idempotency_key: str | None = None) -> JSONResponse:
    accepted = st.control.submit(prepared.request_type, prepared.target, prepared.seq_id, body, prepared.work,
                                 account_id=account_id, idempotency_key=idempotency_key)
    st.runs.training_runs.touch(prepared.target)  # a training run's last_request_time; no-op for other targets
    return future_response(accepted.request_id, model_id=prepared.target, **(prepared.response or {}))


def empty() -> Response:
    return Response(status_code=204)
