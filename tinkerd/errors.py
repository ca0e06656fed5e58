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


class EngineCrashed(RuntimeError):
    """The engine process died mid-step; nothing of that step was stored. Not a request's error:
    control restarts the engine, rebuilds its adapters and runs the step's ops again.

    `self_inflicted`: the process died of what it was doing (a fatal signal such as SIGSEGV or
    SIGABRT, an exit code, or the kernel's OOM killer), not of a SIGKILL from outside (an operator,
    a chaos test). Only such deaths make the ops in flight suspects (control/control.py)."""

    def __init__(self, message: str, self_inflicted: bool = False):
        super().__init__(message)
        self.self_inflicted = self_inflicted
