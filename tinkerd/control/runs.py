"""Sessions, training runs, sampling sessions and the checkpoint registry.

Ids follow the SDK: model_id = `{session_id}:train:{model_seq_id}` (the SDK computes it itself for
create-via-load), sampler id = `{session_id}:sample:{n}`, checkpoint paths
`tinker://<model_id>/<weights|sampler_weights|external_weights>/<name>`.
"""

from __future__ import annotations

import re
import secrets
import shutil
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path

from sqlalchemy import select

from tinkerd.control.store.db import Store, utcnow
from tinkerd.control.store.tables import CheckpointRow, SamplingSessionRow, SessionRow, TrainingRunRow
from tinkerd.errors import NotFoundError, UserError

SEGMENT_TYPES = {"weights": "training", "sampler_weights": "sampler", "external_weights": "external"}
_NAME_RE = re.compile(r"^[A-Za-z0-9._-]{1,128}$")


@dataclass(frozen=True)
class TinkerPath:
    model_id: str
    segment: str
    name: str

    def __str__(self) -> str:
        return f"tinker://{self.model_id}/{self.segment}/{self.name}"

    @property
    def checkpoint_id(self) -> str:
        return f"{self.segment}/{self.name}"


def check_name(name: str) -> str:
    """Checkpoint names become one path segment on disk and in tinker:// paths."""
    if not _NAME_RE.match(name or "") or name in (".", ".."):
        raise UserError(
            f"invalid checkpoint name {name!r}: use 1-128 characters from letters, digits, '.', '_' and '-'"
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


class Runs:
    def __init__(self, store: Store, checkpoints_dir: Path):
        self.store = store
        self.checkpoints_dir = Path(checkpoints_dir)

    # -- sessions --------------------------------------------------------------------------------

    def create_session(self, tags: list[str], user_metadata: dict, sdk_version: str | None) -> str:
        session_id = f"sess-{secrets.token_hex(8)}"
        now = utcnow()
        self.store.add(
            SessionRow(session_id=session_id, created_at=now, last_heartbeat_at=now, tags=list(tags or []),
                       user_metadata=dict(user_metadata or {}), sdk_version=sdk_version)
        )
        return session_id

    def session(self, session_id: str) -> SessionRow:
        row = self.store.get(SessionRow, session_id)
        if row is None:
            raise NotFoundError(f"unknown session_id {session_id!r}")
        return row

    def heartbeat(self, session_id: str) -> None:
        self.session(session_id)
        self.store.update(SessionRow, session_id, last_heartbeat_at=utcnow())

    def finish_session(self, session_id: str, reason: str | None) -> None:
        self.session(session_id)
        self.store.update(SessionRow, session_id, finished_reason=reason or "unknown")

    # -- training runs ---------------------------------------------------------------------------

    def create_run(self, session_id: str, model_seq_id: int, base_model: str, lora_config: dict,
                   user_metadata: dict | None) -> tuple[TrainingRunRow, bool]:
        """The run for `{session_id}:train:{model_seq_id}`; (row, created) — re-sends get the same row."""
        self.session(session_id)
        model_id = f"{session_id}:train:{model_seq_id}"
        now = utcnow()
        row = TrainingRunRow(model_id=model_id, session_id=session_id, base_model=base_model,
                             lora_rank=int(lora_config["rank"]), lora_config=lora_config,
                             user_metadata={str(k): str(v) for k, v in (user_metadata or {}).items()},
                             created_at=now, last_request_at=now)
        created = self.store.add(row)
        return (row if created else self.run(model_id)), created

    def run(self, model_id: str) -> TrainingRunRow:
        row = self.store.get(TrainingRunRow, model_id)
        if row is None:
            raise NotFoundError(f"unknown model_id {model_id!r}")
        return row

    def touch(self, model_id: str) -> None:
        self.store.update(TrainingRunRow, model_id, last_request_at=utcnow())

    def list_runs(self) -> list[TrainingRunRow]:
        return self.store.query(select(TrainingRunRow).order_by(TrainingRunRow.created_at.desc()))

    # -- checkpoints -----------------------------------------------------------------------------

    def checkpoint_dir(self, path: TinkerPath) -> Path:
        return self.checkpoints_dir / path.model_id / path.segment / path.name

    def checkpoint(self, path: TinkerPath) -> CheckpointRow:
        row = self.store.get(CheckpointRow, str(path))
        if row is None or (row.expires_at is not None and row.expires_at <= utcnow()):
            raise NotFoundError(f"checkpoint {path} does not exist")
        return row

    def register_checkpoint(self, path: TinkerPath, ttl_seconds: int | None, user_metadata: dict | None) -> CheckpointRow:
        d = self.checkpoint_dir(path)
        size = sum(f.stat().st_size for f in d.rglob("*") if f.is_file()) if d.exists() else None
        now = utcnow()
        row = CheckpointRow(
            tinker_path=str(path), model_id=path.model_id, checkpoint_type=SEGMENT_TYPES[path.segment],
            name=path.name, dir_path=str(d), created_at=now,
            expires_at=now + timedelta(seconds=ttl_seconds) if ttl_seconds else None, size_bytes=size,
            public=False, user_metadata={str(k): str(v) for k, v in (user_metadata or {}).items()},
        )
        self.store.delete(CheckpointRow, str(path))  # overwrite=True replaces the registration
        self.store.add(row)
        return row

    def checkpoint_exists(self, path: TinkerPath) -> bool:
        try:
            self.checkpoint(path)
            return True
        except NotFoundError:
            return False

    def list_checkpoints(self, model_id: str | None = None) -> list[CheckpointRow]:
        stmt = select(CheckpointRow).order_by(CheckpointRow.created_at.desc())
        if model_id is not None:
            stmt = stmt.where(CheckpointRow.model_id == model_id)
        now = utcnow()
        return [r for r in self.store.query(stmt) if r.expires_at is None or r.expires_at > now]

    def delete_checkpoint(self, path: TinkerPath) -> None:
        row = self.checkpoint(path)
        self.store.delete(CheckpointRow, row.tinker_path)
        shutil.rmtree(row.dir_path, ignore_errors=True)

    # -- sampling sessions -----------------------------------------------------------------------

    def create_sampling_session(self, session_id: str, seq_id: int, base_model: str, model_path: str | None,
                                adapter_dir: str | None) -> SamplingSessionRow:
        self.session(session_id)
        sid = f"{session_id}:sample:{seq_id}"
        row = SamplingSessionRow(sampling_session_id=sid, session_id=session_id, base_model=base_model,
                                 model_path=model_path, adapter_dir=adapter_dir, created_at=utcnow())
        if not self.store.add(row):
            return self.sampling_session(sid)
        return row

    def sampling_session(self, sampling_session_id: str) -> SamplingSessionRow:
        row = self.store.get(SamplingSessionRow, sampling_session_id)
        if row is None:
            raise NotFoundError(f"unknown sampling_session_id {sampling_session_id!r}")
        return row

    def ephemeral_dir(self, sampling_session_id: str) -> Path:
        return self.checkpoints_dir / "_ephemeral" / sampling_session_id


def iso(dt: datetime | None) -> str | None:
    return None if dt is None else dt.strftime("%Y-%m-%dT%H:%M:%S.%fZ")
