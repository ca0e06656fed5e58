"""The checkpoint registry (named checkpoints of training runs) and the sweeper that removes expired
ones. A checkpoint is owned through its run's session (control/sessions.py); a published one is
readable by every account."""

from __future__ import annotations

import logging
from datetime import datetime, timedelta, timezone

from tinkerd.artifacts import ArtifactStore, join, key_of_path
from tinkerd.control.audit import AuditLog
from tinkerd.control.ids import CHECKPOINTS, SEGMENT_TYPES, STALE_TEMP_S, TinkerPath, check_ttl
from tinkerd.control.periodic import Periodic
from tinkerd.control.sessions import Sessions
from tinkerd.control.storage import StorageLedger
from tinkerd.control.store.checkpoints import Checkpoint, CheckpointRepository
from tinkerd.control.store.db import Store, utcnow
from tinkerd.control.store.runs import RunRepository
from tinkerd.errors import NotFoundError, ServerError

log = logging.getLogger(__name__)


class Checkpoints:
    """The checkpoint registry: rows pointing at checkpoint files under CHECKPOINTS (artifacts.py)."""

    # A checkpoint is registered (its row added) only by the finalize step of the op that wrote it,
    # i.e. after the engine renamed the finished directory into place: a row always points at a
    # whole checkpoint. Expired rows are treated as absent everywhere at once (lookups and listings
    # filter them) and removed, with their files, only by CheckpointSweeper: a lookup or a listing
    # never deletes, so a GET never waits on an rmtree of gigabytes (issue 18: one such GET once held
    # the event loop, and every long-poll with it).

    def __init__(self, store: Store, artifacts: ArtifactStore, sessions: Sessions, audit: AuditLog | None = None):
        self.store = store
        self.sessions = sessions
        self.checkpoints = CheckpointRepository(store)
        self.training_runs = RunRepository(store)
        # Checkpoint files, by key under CHECKPOINTS (tinkerd/artifacts.py): the engine writes them,
        # control lists, copies and deletes them, both through the store.
        self.artifacts = artifacts
        # GB-hour storage billing: told when a checkpoint goes (its storage ends then).
        self.storage = StorageLedger(store)
        # Publishing, unpublishing, deleting and copying checkpoints are audited (control/audit.py).
        self.audit = audit or AuditLog(store)

    def checkpoint_key(self, path: TinkerPath) -> str:
        """The artifact key of a named checkpoint: `checkpoints/<model_id>/<segment>/<name>`."""
        return join(CHECKPOINTS, path.model_id, path.segment, path.name)

    @staticmethod
    def key_of(row: Checkpoint) -> str:
        """A checkpoint row's artifact key (rows written before keys hold the absolute path)."""
        return key_of_path(row.dir_path)

    def checkpoint(self, path: TinkerPath) -> Checkpoint:
        row = self.checkpoints.get(str(path))
        if row is None or _expired(row, utcnow()):
            raise NotFoundError(f"checkpoint {path} does not exist")
        return row

    def owned_checkpoint(self, path: TinkerPath, account_id: str | None, public_ok: bool = False) -> Checkpoint:
        """The checkpoint if the account owns it (or, with public_ok, if it is published)."""
        row = self.checkpoint(path)
        if account_id is None or (public_ok and row.public):
            return row
        run = self.training_runs.get(row.model_id)
        if run is None or self.sessions.account_of(run.session_id) != account_id:
            raise NotFoundError(f"checkpoint {path} does not exist")
        return row

    def register_checkpoint(self, path: TinkerPath, ttl_seconds: int | None, user_metadata: dict | None) -> Checkpoint:
        key = self.checkpoint_key(path)
        if not self.artifacts.exists(key):
            # The engine reported success but the artifact is gone (deleted or swept meanwhile):
            # fail the save rather than register a checkpoint without files.
            raise ServerError(f"checkpoint {path} was written but its files are missing; save it again")
        size = self.artifacts.size(key)
        now = utcnow()
        row = Checkpoint(
            tinker_path=str(path), model_id=path.model_id, checkpoint_type=SEGMENT_TYPES[path.segment],
            name=path.name, dir_path=key, created_at=now,
            expires_at=now + timedelta(seconds=ttl_seconds) if ttl_seconds else None, size_bytes=size,
            public=False, user_metadata={str(k): str(v) for k, v in (user_metadata or {}).items()},
        )
        old = self.checkpoints.get(str(path))
        if old is not None:  # overwrite=True replaces the registration: the old files' storage ends
            self.storage.removed(old, now)
            self.checkpoints.delete(str(path))
        self.checkpoints.add(row)
        return row

    def checkpoint_exists(self, path: TinkerPath) -> bool:
        try:
            self.checkpoint(path)
            return True
        except NotFoundError:
            return False

    def list_checkpoints(self, model_id: str | None = None, checkpoint_type: str | None = None,
                         limit: int | None = None, offset: int = 0, account_id: str | None = None,
                         project_id: str | None = None) -> tuple[list[Checkpoint], int]:
        """A page of live checkpoints (of one account, or all), newest first, and how many there are in all."""
        return self.checkpoints.page(utcnow(), model_id, checkpoint_type, limit, offset, account_id, project_id)

    def last_checkpoint(self, model_id: str, checkpoint_type: str) -> Checkpoint | None:
        """The newest live checkpoint of a type (no sweep: a listing of runs asks this per run)."""
        return self.checkpoints.newest(model_id, checkpoint_type, utcnow())

    def delete_checkpoint(self, path: TinkerPath, account_id: str | None = None) -> None:
        row = self.owned_checkpoint(path, account_id)
        self._remove(row)
        self.audit_checkpoint("checkpoint_deleted", row)

    def set_ttl(self, path: TinkerPath, ttl_seconds: int | None, account_id: str | None = None) -> Checkpoint:
        """Expire `ttl_seconds` from now; None removes the expiry."""
        row = self.owned_checkpoint(path, account_id)
        ttl = check_ttl(ttl_seconds)
        expires_at = utcnow() + timedelta(seconds=ttl) if ttl is not None else None
        self.checkpoints.set(row.tinker_path, expires_at=expires_at)
        return self.checkpoint(path)

    def set_public(self, path: TinkerPath, public: bool, account_id: str | None = None) -> None:
        row = self.owned_checkpoint(path, account_id)
        self.checkpoints.set(row.tinker_path, public=public)
        self.audit_checkpoint("checkpoint_published" if public else "checkpoint_unpublished", row)

    def audit_checkpoint(self, event: str, row: Checkpoint, **details) -> None:
        run = self.training_runs.get(row.model_id)
        owner = self.sessions.account_of(run.session_id) if run is not None else None
        self.audit.record(event, owner, model_id=row.model_id, tinker_path=row.tinker_path, **details)

    def sweep_expired(self) -> int:
        """Remove every expired checkpoint (row and files); returns how many. CheckpointSweeper's
        thread only: storage billing ends at the expiry, whenever the sweep comes (storage.py)."""
        now = utcnow()
        expired = self.checkpoints.expired(now)
        for row in expired:
            self._remove(row)
        return len(expired)

    def sweep_stale_temp(self, older_than_s: float = STALE_TEMP_S) -> int:
        """Clear what a crashed save left next to checkpoints (ArtifactStore.sweep_incomplete,
        control/debris.py); returns how many. older_than_s=0 only while no engine save can be
        running (at start-up, after an engine restart); the store's own writes in progress (a
        copy_weights) are always kept."""
        return len(self.artifacts.sweep_incomplete(CHECKPOINTS, older_than_s))

    def _remove(self, row: Checkpoint) -> None:
        self.storage.removed(row)
        self.checkpoints.delete(row.tinker_path)
        key = self.key_of(row)
        modified = self.artifacts.modified(key)
        if modified is None:
            return
        # A save under the same name may have put a newer artifact under the key after this row was
        # read (a re-save after expiry, or overwrite=True, racing the sweeper). The artifact of this
        # row was finished before the row was created; a newer one was written after it.
        if datetime.fromtimestamp(modified, timezone.utc).replace(tzinfo=None) > row.created_at:
            log.info("not deleting %s: it holds a newer save than the removed %s", key, row.tinker_path)
            return
        self.artifacts.delete(key)


def _expired(row: Checkpoint, now: datetime) -> bool:
    return row.expires_at is not None and row.expires_at <= now


class CheckpointSweeper(Periodic):
    """A daemon thread that removes expired checkpoints every `interval_s`, so their disk space comes
    back even when nobody lists or opens them, and clears temporary debris of crashed saves.

    Policy: expiry is exact for the API (lookups and listings treat an expired row as gone at once);
    the sweeper alone deletes, off every request path, and bounds how long the files of an expired
    checkpoint stay on disk, to `interval_s`.
    """

    thread_name, tick_first = "tinkerd-checkpoint-sweeper", True

    def __init__(self, checkpoints: Checkpoints, interval_s: float):
        super().__init__(interval_s)
        self.checkpoints = checkpoints

    def tick(self) -> None:
        removed = self.checkpoints.sweep_expired()
        if removed:
            log.info("removed %d expired checkpoint(s)", removed)
        self.checkpoints.sweep_stale_temp()
