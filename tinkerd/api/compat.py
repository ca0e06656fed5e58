"""Requests from SDKs newer than the one whose schema tinkerd validates against (tinker 0.38.0).

The SDK's pydantic request models forbid unknown fields, so validating with them as they are would
turn one field added by a later SDK into a 400 on every `create_session` or `retrieve_future`, which
the SDK does not retry: the user's loop dies at its first request. Instead a field the schema does
not know is dropped and the rest is validated as usual, so a wrong type or a missing field is still
a `user` error. Each new unknown field is logged once per process, and `create_session` tells the
client which fields of its session request were ignored (`warning_message`, which the SDK logs).

Protobuf bodies (forward_backward) need none of this: protobuf parsing keeps unknown fields aside.
"""

from __future__ import annotations

import logging
import threading
from importlib.metadata import PackageNotFoundError, version
from typing import Any, TypeVar

import pydantic

log = logging.getLogger(__name__)

M = TypeVar("M", bound=pydantic.BaseModel)

try:
    SCHEMA_SDK_VERSION = version("tinker")
except PackageNotFoundError:  # not installed as a distribution (a source checkout of the SDK)
    SCHEMA_SDK_VERSION = "0.38.0"

# Field paths already logged, so a newer SDK's field costs one log line, not one per request.
# Process-wide on purpose: it only keeps the log quiet and holds at most a few dozen names.
_logged: set[str] = set()
_logged_lock = threading.Lock()


def validate_lenient(model: type[M], body: bytes) -> tuple[M, list[str]]:
    """`model` from the JSON `body`, with fields the schema does not know ignored (their dotted paths
    are returned). Raises pydantic.ValidationError for every other problem, as strict validation would."""
    try:
        return model.model_validate_json(body or b"{}"), []
    except pydantic.ValidationError as strict:
        if not any(e["type"] == "extra_forbidden" for e in strict.errors()):
            raise
        # pydantic's own switch, applied to every nested model: the rest is validated exactly as before.
        obj = model.model_validate_json(body or b"{}", extra="ignore")
        unknown = [e["loc"] for e in strict.errors() if e["type"] == "extra_forbidden"]
    paths = sorted({path for is_field, path in (_locate(obj, loc) for loc in unknown) if not is_field})
    _log_new(model.__name__, paths)
    return obj, paths


def _locate(obj: Any, loc: tuple) -> tuple[bool, str]:
    """Whether pydantic's error location `loc` names a field of the validated `obj`, and its dotted
    path in the data. A plain union reports errors for each member it tried: in
    `chunks.0.ImageChunk.tokens`, `tokens` is "extra" to ImageChunk but a field of the EncodedTextChunk
    that matched (so not ignored at all), and `ImageChunk` is a member's name, not a step in the data.
    List indices are left out of the path: `data.model_input.x`, whichever datum carried it."""
    node, steps = obj, []
    for part in loc[:-1]:
        if isinstance(part, int) and isinstance(node, (list, tuple)) and 0 <= part < len(node):
            node = node[part]
        elif isinstance(node, pydantic.BaseModel) and part in type(node).model_fields:
            node = getattr(node, part)
            steps.append(part)
        elif isinstance(node, dict) and part in node:
            node = node[part]
            steps.append(str(part))
        # else: a union member's name
    steps.append(str(loc[-1]))
    return isinstance(node, pydantic.BaseModel) and loc[-1] in type(node).model_fields, ".".join(steps)


def _log_new(model_name: str, paths: list[str]) -> None:
    with _logged_lock:
        new = [p for p in paths if f"{model_name}.{p}" not in _logged]
        _logged.update(f"{model_name}.{p}" for p in new)
    for path in new:
        log.warning("ignoring unknown field %s.%s (this server validates against tinker %s; a newer SDK "
                    "sent it)", model_name, path, SCHEMA_SDK_VERSION)


def session_warning(sdk_version: str | None, ignored: list[str]) -> str | None:
    """`create_session`'s warning_message for a client the server may not fully understand."""
    newer = _is_newer(sdk_version)
    if not ignored and not newer:
        return None
    text = f"this tinkerd server speaks the wire of tinker {SCHEMA_SDK_VERSION}"
    if newer:
        text += f" and your SDK is {sdk_version}: request fields it does not know are ignored"
    if ignored:
        text += f"; ignored in create_session: {', '.join(ignored)}"
    return text


def _is_newer(sdk_version: str | None) -> bool:
    from packaging.version import InvalidVersion, Version

    try:
        return sdk_version is not None and Version(sdk_version) > Version(SCHEMA_SDK_VERSION)
    except InvalidVersion:
        return False
