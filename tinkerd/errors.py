"""One error hierarchy. Each error carries the SDK's category (`Category`) and an HTTP status
(`http.HTTPStatus`).

The SDK retries 408/409/429/5xx for minutes, so a caller's mistake must never be one of those:
`UserError` is 400 (or 404 for things that do not exist) and fails the request's own future.
Errors that cross the engine's pipe or Ray are of this hierarchy too (`EngineCrashed`,
`EngineFailure`), never a bare RuntimeError.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Any
from http import HTTPStatus


class Category(StrEnum):
    """The `category` of an error body and of a failed future, as the SDK reads it. A str: it is
    stored and sent as its value ("user", "server")."""

    USER = "user"
    SERVER = "server"


class TinkerdError(Exception):
    category: Category = Category.SERVER
    status_code: HTTPStatus = HTTPStatus.INTERNAL_SERVER_ERROR

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


class UserError(TinkerdError):
    """The caller sent something we will never accept; retrying cannot help."""

    category = Category.USER
    status_code = HTTPStatus.BAD_REQUEST


class NotFoundError(UserError):
    status_code = HTTPStatus.NOT_FOUND


class ServerError(TinkerdError):
    """Our fault; reported through the future with category 'server'."""

    category = Category.SERVER
    status_code = HTTPStatus.INTERNAL_SERVER_ERROR


class StorageUnavailable(ServerError):
    """The data directory cannot take new writes: its free space is under the reserve
    (control/diskspace.py), or the store failed a write (disk full, I/O error, database locked).

    HTTP 503 with Retry-After: the SDK retries 5xx submissions (its training calls back off 0.5 s
    doubling to 10 s, for up to 2 h without progress; plain calls honour a Retry-After of up to
    60 s), which is the intended "wait as for capacity". Accepted ops never fail with it: their
    results are retried until stored (control/results.py)."""

    status_code = HTTPStatus.SERVICE_UNAVAILABLE
    # Long enough that a waiting client does not hammer a full server, short enough that work
    # resumes within ~10 s of an operator freeing space; the SDK's own retry cap is 10 s too.
    retry_after_s = 10

    @property
    def headers(self) -> dict[str, str]:
        return {"Retry-After": str(self.retry_after_s)}


class QueueFull(TinkerdError):
    """A queue is over its budget (control/backpressure.py): new work is refused, not dropped.

    HTTP 429 with Retry-After, the SDK's rate-limit answer: it backs off and sends the op again
    (its HTTP client honours a Retry-After of up to 60 s; its training calls back off further for
    5 minutes). Not the caller's mistake, so not a `user` error."""

    category = Category.SERVER
    status_code = HTTPStatus.TOO_MANY_REQUESTS
    # One op leaving the queue frees a place; a training step here takes 0.1-10 s, so a client
    # asking again every second finds it soon without hammering the server.
    retry_after_s = 1

    @property
    def headers(self) -> dict[str, str]:
        return {"Retry-After": str(self.retry_after_s)}


class EngineCrashed(ServerError):
    """The engine process died mid-step; nothing of that step was stored. Not a request's error:
    control restarts the engine, rebuilds its adapters and runs the step's ops again.

    `self_inflicted`: the process died of what it was doing (a fatal signal such as SIGSEGV or
    SIGABRT, an exit code, or the kernel's OOM killer), not of a SIGKILL from outside (an operator,
    a chaos test). Only such deaths make the ops in flight suspects (control/control.py)."""

    def __init__(self, message: str, self_inflicted: bool = False):
        super().__init__(message)
        self.self_inflicted = self_inflicted


class EnginesCrashed(EngineCrashed):
    """Some engines behind a router died in a step (control/engines.py): `base_models` they served
    (whose runs need rebuilding), `lost` tickets they held (to run again), and `output`, the
    StepOutput of what the live engines finished in that step (to complete as usual)."""

    def __init__(self, message: str, base_models: frozenset[str] = frozenset(), lost: frozenset[str] = frozenset(),
                 output: Any = None, self_inflicted: bool = False):
        super().__init__(message, self_inflicted)
        self.base_models = base_models
        self.lost = lost
        self.output = output


class EngineFailure(ServerError):
    """The engine raised something unexpected in a call (a bug in its loop, not in one op, which
    the engine fails alone): sent back across the process pipe as this, with the original's type
    and message. Control fails the ops it held and keeps serving (control/control.py)."""


class AuthError(TinkerdError):
    category = Category.USER
    status_code = HTTPStatus.UNAUTHORIZED


class InvalidTokenError(AuthError):
    headers = {"WWW-Authenticate": 'Bearer error="invalid_token"'}


class SignInRequired(AuthError):
    """No valid console session: pages redirect to the sign-in page, fragments answer 401."""


class Forbidden(UserError):
    status_code = HTTPStatus.FORBIDDEN


class LinkRefused(UserError):
    status_code = HTTPStatus.FORBIDDEN


class CsrfError(UserError):
    status_code = HTTPStatus.FORBIDDEN


class PayloadTooLarge(UserError):
    status_code = HTTPStatus.REQUEST_ENTITY_TOO_LARGE


class ArchiveTooLarge(UserError):
    status_code = HTTPStatus.REQUEST_ENTITY_TOO_LARGE


class UnservableModel(UserError):
    """A base model whose family tinkerd does not serve; `message` says which and why."""


class UnrecoverableRun(UserError):
    """An op for a run recovery could not rebuild: the recorded reason, not a retryable fault."""


class OpenAIError(UserError):
    """A 400 that names the offending parameter, as OpenAI's errors do."""

    def __init__(self, message: str, param: str | None = None, status_code: int = HTTPStatus.BAD_REQUEST,
                 code: str | None = None):
        super().__init__(message)
        self.param = param
        self.code = code
        self.status_code = HTTPStatus(status_code)


class EngineStartFailed(EngineCrashed):
    """The engine process could not build its engine (a model that does not load, say): the child's
    own reason, which `tinkerd serve` prints as its one error line."""
