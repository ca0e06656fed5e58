"""copy_weights: a checkpoint the caller may read (its own, or a published one), copied into a
training run the caller owns.

The copy is a checkpoint like any other: its own row and its own files (copied through the
ArtifactStore, which makes it visible whole or not at all: a crash leaves debris the sweeper clears,
never a half copy under the real name), listed, loadable, billed as storage to its owner.

The SDK sends either a session and a model slot (`{session_id}:train:{model_seq_id}` must not
exist yet: a copy's run holds copies only and cannot be trained on) or a destination project. With
a project the copy goes into a new session of the caller's in that project (control/projects.py),
whose id is derived from the request's idempotency key: a retried request finds the copy it already
made. With a session, the copy is in that session's project.
"""

from __future__ import annotations

import hashlib
import secrets

from tinkerd.control.projects import check_project_id
from tinkerd.control.ids import TinkerPath, check_ttl, parse_tinker_path
from tinkerd.control.runs import Runs
from tinkerd.control.store.db import utcnow
from tinkerd.control.store.runs import RunRepository, TrainingRun
from tinkerd.control.store.sessions import Session, SessionRepository
from tinkerd.errors import UserError

# lora_config key marking a run made by copy_weights (training ops refuse it).
COPY_OF = "copy_of"


def is_copy_run(run: TrainingRun) -> bool:
    return bool((run.lora_config or {}).get(COPY_OF))


def trainable_config(lora_config: dict | None) -> dict:
    """A run's LoRA config for a new run loaded from its checkpoint: without the copy marker (a run
    created from a copy trains like any other)."""
    return {k: v for k, v in (lora_config or {}).items() if k != COPY_OF}


def copy_weights(runs: Runs, source_path: str, account_id: str | None, *, session_id: str | None = None,
                 model_seq_id: int | None = None, project_id: str | None = None, ttl_seconds: int | None = None,
                 idempotency_key: str | None = None) -> TinkerPath:
    source = parse_tinker_path(source_path)
    ttl = check_ttl(ttl_seconds)
    by_slot = session_id is not None and model_seq_id is not None
    if not by_slot and not (session_id is None and model_seq_id is None and project_id):
        raise UserError("copy_weights needs destination_project_id, or both session_id and model_seq_id")
    ckpt = runs.checkpoints.owned_checkpoint(source, account_id, public_ok=True)  # foreign unpublished == missing
    source_run = runs.training_runs.run(ckpt.model_id)
    training_runs = RunRepository(runs.store)
    if by_slot:
        runs.sessions.owned_session(session_id, account_id)
        model_id = f"{session_id}:train:{model_seq_id}"
        if training_runs.get(model_id) is not None:
            raise UserError(f"training run {model_id} already exists: copy into an unused model_seq_id")
    else:
        session_id = _copy_session(runs, account_id, idempotency_key, check_project_id(project_id))
        model_id = f"{session_id}:train:0"
    dest = TinkerPath(model_id, source.segment, source.name)
    existing = training_runs.get(model_id)
    if existing is not None and runs.checkpoints.checkpoint_exists(dest):
        return dest  # the same request, retried after it completed
    now = utcnow()
    training_runs.add(TrainingRun(
        model_id=model_id, session_id=session_id, base_model=source_run.base_model, lora_rank=source_run.lora_rank,
        lora_config={**(source_run.lora_config or {}), COPY_OF: str(source)},
        user_metadata=dict(source_run.user_metadata or {}), created_at=now, last_request_at=now))
    # Never in the engine: marked so, residency does not try to release it or count it as loaded.
    training_runs.mark_unloaded(model_id, now)
    _copy_files(runs, runs.checkpoints.key_of(ckpt), runs.checkpoints.checkpoint_key(dest))
    row = runs.checkpoints.register_checkpoint(dest, ttl, ckpt.user_metadata)
    runs.checkpoints.audit_checkpoint("checkpoint_copied", row, source_path=str(source))
    return dest


def _copy_session(runs: Runs, account_id: str | None, idempotency_key: str | None, project_id: str) -> str:
    """The session that holds one copy: derived from the idempotency key (per account, so another
    account's key cannot name it), or new without one."""
    if idempotency_key:
        digest = hashlib.sha256(f"{account_id}\0{idempotency_key}".encode()).hexdigest()[:16]
        session_id = f"sess-{digest}"
        row = SessionRepository(runs.store).get(session_id)
        if row is not None and row.account_id == account_id:
            return session_id
    else:
        session_id = f"sess-{secrets.token_hex(8)}"
    now = utcnow()
    # Finished at once: nobody heart-beats it, and its run must not count as a live one for quotas.
    SessionRepository(runs.store).add(Session(session_id=session_id, account_id=account_id, created_at=now, last_heartbeat_at=now,
                              tags=["copy_weights"], user_metadata={}, sdk_version=None, finished_reason="copy_weights",
                              display_name=None, project_id=project_id))
    return runs.sessions.owned_session(session_id, account_id).session_id


def _copy_files(runs: Runs, src: str, dst: str) -> None:
    """The artifact `src` copied to `dst` through the store (written whole or not at all: a crash
    leaves only what ArtifactStore.sweep_incomplete removes)."""
    if not runs.artifacts.exists(src):
        raise UserError(f"checkpoint files of {src.rsplit('/', 1)[-1]} are missing; it cannot be copied")
    runs.artifacts.copy(src, dst)
