"""The names of what the run registry holds, and how requests spell them.

Ids follow the SDK: model_id = `{session_id}:train:{model_seq_id}` (the SDK computes it itself for
create-via-load), sampler id = `{session_id}:sample:{n}`, checkpoint paths
`tinker://<model_id>/<weights|sampler_weights|external_weights>/<name>`; checkpoint files lie under
artifact keys (tinkerd/artifacts.py) derived from those.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import datetime

from tinkerd.artifacts import join, key_of_path
from tinkerd.errors import UserError

SEGMENT_TYPES = {"weights": "training", "sampler_weights": "sampler", "external_weights": "external"}
TYPE_SEGMENTS = {v: k for k, v in SEGMENT_TYPES.items()}
_NAME_RE = re.compile(r"^[A-Za-z0-9._-]{1,128}$")
# TrainingRun.model_owner (a field the SDK requires) of runs whose session has no account.
LOCAL_OWNER = "local"
# The protocol's upper bound for checkpoint TTLs. Its lower bound (3600 s on the hosted service) is
# not enforced: the SDK does not check it either, and short TTLs are useful on a self-hosted server.
MAX_TTL_SECONDS = 10 * 366 * 24 * 3600
# The writer's temporary and set-aside directories (tinkerd/artifacts.py); one older than this is
# debris of a crash mid-save (saves take seconds), never a save still in progress.
STALE_TEMP_S = 3600.0
# Key prefixes (tinkerd/artifacts.py): named checkpoints under checkpoints/<model_id>/<segment>/<name>,
# ephemeral samplers under checkpoints/_ephemeral/<sampling_session_id>.
CHECKPOINTS = "checkpoints"
EPHEMERAL = join(CHECKPOINTS, "_ephemeral")


def parent_key(value: str | None) -> str | None:
    """The key prefix an adapter_dir (a key, or a path written before keys) lies under."""
    try:
        return key_of_path(value).rsplit("/", 1)[0] if value else None
    except ValueError:
        return None


@dataclass(frozen=True)
class TinkerPath:
    model_id: str
    segment: str
    name: str

    def __str__(self) -> str:
        return f"tinker://{self.model_id}/{self.segment}/{self.name}"


def check_name(name: str, field: str = "checkpoint name") -> str:
    """Checkpoint names become one path segment on disk and in tinker:// paths: no '' (it made
    `weights/step-None`), '/', '..', NUL or names over 128 characters. `field` names the request
    field in the error."""
    if not isinstance(name, str) or not _NAME_RE.fullmatch(name) or name in (".", ".."):
        shown = name if not isinstance(name, str) or len(name) <= 140 else f"{name[:128]}... ({len(name)} characters)"
        raise UserError(
            f"invalid {field} {shown!r}: use 1-128 characters from letters, digits, '.', '_' and '-'"
        )
    return name


def parse_tinker_path(path: str) -> TinkerPath:
    if not isinstance(path, str) or not path.startswith("tinker://"):
        raise UserError(f"invalid path {path!r}: expected tinker://<run_id>/<type>/<name>")
    parts = path[len("tinker://") :].split("/")
    if len(parts) != 3 or not parts[0] or parts[1] not in SEGMENT_TYPES:
        raise UserError(
            f"invalid path {path!r}: expected tinker://<run_id>/<weights|sampler_weights|external_weights>/<name>"
        )
    return TinkerPath(parts[0], parts[1], check_name(parts[2]))


def check_ttl(ttl_seconds) -> int | None:
    """A checkpoint TTL from a request: None (never expires) or 1 s .. 10 years."""
    if ttl_seconds is None:
        return None
    if isinstance(ttl_seconds, bool) or not isinstance(ttl_seconds, int):
        raise UserError(f"ttl_seconds must be an integer number of seconds or null, got {ttl_seconds!r}")
    if not 0 < ttl_seconds <= MAX_TTL_SECONDS:
        raise UserError(f"ttl_seconds must be between 1 and {MAX_TTL_SECONDS} (10 years), got {ttl_seconds}")
    return ttl_seconds


def iso(dt: datetime | None) -> str | None:
    return None if dt is None else dt.strftime("%Y-%m-%dT%H:%M:%S.%fZ")
