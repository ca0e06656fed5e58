"""One error hierarchy. Each error carries the SDK's category and an HTTP status.

The SDK retries 408/409/429/5xx for minutes, so a caller's mistake must never be one of those:
`UserError` is 400 (or 404 for things that do not exist) and fails the request's own future.
"""

from __future__ import annotations


class TinkerdError(Exception):
    category: str = "server"
    status_code: int = 500

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


class UserError(TinkerdError):
    """The caller sent something we will never accept; retrying cannot help."""

    category = "user"
    status_code = 400


class NotFoundError(UserError):
    status_code = 404


class ServerError(TinkerdError):
    """Our fault; reported through the future with category 'server'."""

    category = "server"
    status_code = 500


class StorageUnavailable(ServerError):
    """The data directory cannot take new writes: its free space is under the reserve
    (control/diskspace.py), or the store failed a write (disk full, I/O error, database locked).

    HTTP 503 with Retry-After: the SDK retries 5xx submissions (its training calls back off 0.5 s
    doubling to 10 s, for up to 2 h without progress; plain calls honour a Retry-After of up to
    60 s), which is the intended "wait as for capacity". Accepted ops never fail with it: their
    results are retried until stored (control/results.py)."""

    status_code = 503
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

    category = "server"
    status_code = 429
    # One op leaving the queue frees a place; a training step here takes 0.1-10 s, so a client
    # asking again every second finds it soon without hammering the server.
    retry_after_s = 1

    @property
    def headers(self) -> dict[str, str]:
        return {"Retry-After": str(self.retry_after_s)}


class EngineCrashed(RuntimeError):
    """The engine process died mid-step; nothing of that step was stored. Not a request's error:
    control restarts the engine, rebuilds its adapters and runs the step's ops again.

    `self_inflicted`: the process died of what it was doing (a fatal signal such as SIGSEGV or
    SIGABRT, an exit code, or the kernel's OOM killer), not of a SIGKILL from outside (an operator,
    a chaos test). Only such deaths make the ops in flight suspects (control/control.py)."""

    def __init__(self, message: str, self_inflicted: bool = False):
        super().__init__(message)
        self.self_inflicted = self_inflicted
