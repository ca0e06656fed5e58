"""Sessions, training runs, sampling sessions and the checkpoint registry.

Ownership: a session belongs to the account of the key that created it; its runs, their checkpoints
and its sampling sessions belong to the same account. The `owned_*` lookups answer another
account's ids exactly like missing ones (NotFoundError, same message), so nothing leaks that an id
exists. `account_id=None` means an internal caller (recovery, tests) and skips the check.

Ids follow the SDK: model_id = `{session_id}:train:{model_seq_id}` (the SDK computes it itself for
create-via-load), sampler id = `{session_id}:sample:{n}`, checkpoint paths
`tinker://<model_id>/<weights|sampler_weights|external_weights>/<name>`.
"""

from __future__ import annotations

import logging
import re
import secrets
import threading
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import Any, Callable

from tinkerd.artifacts import ArtifactStore, join, key_of_path
from tinkerd.control.audit import AuditLog
from tinkerd.control.storage import StorageLedger
from tinkerd.control.store.checkpoints import CheckpointRepository
from tinkerd.control.store.db import Store, utcnow
from tinkerd.control.store.runs import RunRepository
from tinkerd.control.store.sampling import SamplingSession, SamplingSessionRepository
from tinkerd.control.store.sessions import Session, SessionRepository
from tinkerd.control.store.tables import CheckpointRow, TrainingRunRow
from tinkerd.errors import NotFoundError, ServerError, UserError

log = logging.getLogger(__name__)

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


def _parent(value: str | None) -> str | None:
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


class Runs:
    def __init__(self, store: Store, artifacts: ArtifactStore, audit: AuditLog | None = None):
        self.store = store
        self.sessions = SessionRepository(store)
        self.training_runs = RunRepository(store)
        self.checkpoints = CheckpointRepository(store)
        self.samplers = SamplingSessionRepository(store)
        # Checkpoint files, by key under CHECKPOINTS (tinkerd/artifacts.py): the engine writes them,
        # control lists, copies and deletes them, both through the store.
        self.artifacts = artifacts
        # GB-hour storage billing: told when a checkpoint goes (its storage ends then).
        self.storage = StorageLedger(store)
        # Publishing, unpublishing, deleting and copying checkpoints are audited (control/audit.py).
        self.audit = audit or AuditLog(store)
        # The data directory's free-space reserve (control/diskspace.py): a new session is new work,
        # refused under it. None (tests) never refuses.
        self.reserve = None

    # -- sessions --------------------------------------------------------------------------------

    def create_session(self, tags: list[str], user_metadata: dict, sdk_version: str | None,
                       account_id: str | None = None, display_name: str | None = None,
                       project_id: str | None = None, session_id: str | None = None) -> str:
        """A new session; `session_id`: a fixed id (an API key's implicit session, api/hpcai.py)."""
        if self.reserve is not None:
            self.reserve.check()
        session_id = session_id or f"sess-{secrets.token_hex(8)}"
        now = utcnow()
        self.sessions.add(Session(session_id=session_id, account_id=account_id, created_at=now, last_heartbeat_at=now,
                                  tags=list(tags or []), user_metadata=dict(user_metadata or {}), sdk_version=sdk_version,
                                  finished_reason=None, display_name=display_name, project_id=project_id))
        return session_id

    def _lookup(self, get: Callable[[str], Any], key: str, what: str, account_id: str | None = None):
        """What `get` finds under `key`, or NotFoundError; with an account, another account's is
        missing too (same message, so existence never leaks). Non-sessions are owned through their session."""
        row = get(key)
        if row is not None and account_id is not None:
            owner = row.account_id if isinstance(row, Session) else self.account_of(row.session_id)
            if owner != account_id:
                row = None
        if row is None:
            raise NotFoundError(f"unknown {what} {key!r}")
        return row

    def session(self, session_id: str) -> Session:
        return self._lookup(self.sessions.get, session_id, "session_id")

    def owned_session(self, session_id: str, account_id: str | None) -> Session:
        return self._lookup(self.sessions.get, session_id, "session_id", account_id)

    def session_exists(self, session_id: str) -> bool:
        return self.sessions.get(session_id) is not None

    def run_count(self, session_id: str) -> int:
        """How many training runs the session has made: the next model_seq_id of an implicit session."""
        return self.training_runs.count_of_session(session_id)

    def account_of(self, session_id: str) -> str | None:
        row = self.sessions.get(session_id)
        return row.account_id if row is not None else None

    def set_project(self, session_id: str, project_id: str, account_id: str | None) -> None:
        row = self.owned_session(session_id, account_id)
        self.sessions.set(session_id, project_id=project_id)
        self.audit.record("project_session_assigned", row.account_id, session_id=session_id, project_id=project_id,
                          previous_project_id=row.project_id)

    def heartbeat(self, session_id: str, account_id: str | None = None) -> None:
        self.owned_session(session_id, account_id)
        self.sessions.set(session_id, last_heartbeat_at=utcnow())

    def finish_session(self, session_id: str, reason: str | None, account_id: str | None = None) -> None:
        self.owned_session(session_id, account_id)
        self.sessions.set(session_id, finished_reason=reason or "unknown")

    # -- training runs ---------------------------------------------------------------------------

    def create_run(self, session_id: str, model_seq_id: int, base_model: str, lora_config: dict,
                   user_metadata: dict | None, account_id: str | None = None) -> tuple[TrainingRunRow, bool]:
        """The run for `{session_id}:train:{model_seq_id}`; (row, created) — re-sends get the same row."""
        self.owned_session(session_id, account_id)
        model_id = f"{session_id}:train:{model_seq_id}"
        now = utcnow()
        row = TrainingRunRow(model_id=model_id, session_id=session_id, base_model=base_model,
                             lora_rank=int(lora_config["rank"]), lora_config=lora_config,
                             user_metadata={str(k): str(v) for k, v in (user_metadata or {}).items()},
                             created_at=now, last_request_at=now)
        created = self.store.add(row)
        return (row if created else self.run(model_id)), created

    def run(self, model_id: str) -> TrainingRunRow:
        return self._lookup(self.training_runs.get, model_id, "model_id")

    def owned_run(self, model_id: str, account_id: str | None) -> TrainingRunRow:
        return self._lookup(self.training_runs.get, model_id, "model_id", account_id)

    def touch(self, model_id: str) -> None:
        self.store.update(TrainingRunRow, model_id, last_request_at=utcnow())

    def list_runs(self, limit: int | None = None, offset: int = 0, account_id: str | None = None,
                  project_id: str | None = None) -> tuple[list[TrainingRunRow], int]:
        """A page of runs (of one account, or all; of one of its projects), newest first, and how many
        there are in all."""
        return self.training_runs.page(limit, offset, account_id, project_id)

    def base_models(self, model_ids) -> dict[str, str]:
        """model_id -> base model, for the runs among `model_ids` (one query for a page of checkpoints)."""
        return self.training_runs.base_models(model_ids)

    # -- checkpoints -----------------------------------------------------------------------------
    #
    # A checkpoint is registered (its row added) only by the finalize step of the op that wrote it,
    # i.e. after the engine renamed the finished directory into place: a row always points at a
    # whole checkpoint. Expired rows are treated as absent everywhere at once (lookups and listings
    # filter them) and removed, with their files, only by CheckpointSweeper: a lookup or a listing
    # never deletes, so a GET never waits on an rmtree of gigabytes (issue 18: one such GET once held
    # the event loop, and every long-poll with it).

    def checkpoint_key(self, path: TinkerPath) -> str:
        """The artifact key of a named checkpoint: `checkpoints/<model_id>/<segment>/<name>`."""
        return join(CHECKPOINTS, path.model_id, path.segment, path.name)

    @staticmethod
    def key_of(row: CheckpointRow) -> str:
        """A checkpoint row's artifact key (rows written before keys hold the absolute path)."""
        return key_of_path(row.dir_path)

    def checkpoint(self, path: TinkerPath) -> CheckpointRow:
        row = self.store.get(CheckpointRow, str(path))
        if row is None or _expired(row, utcnow()):
            raise NotFoundError(f"checkpoint {path} does not exist")
        return row

    def owned_checkpoint(self, path: TinkerPath, account_id: str | None, public_ok: bool = False) -> CheckpointRow:
        """The checkpoint if the account owns it (or, with public_ok, if it is published)."""
        row = self.checkpoint(path)
        if account_id is None or (public_ok and row.public):
            return row
        run = self.store.get(TrainingRunRow, row.model_id)
        if run is None or self.account_of(run.session_id) != account_id:
            raise NotFoundError(f"checkpoint {path} does not exist")
        return row

    def register_checkpoint(self, path: TinkerPath, ttl_seconds: int | None, user_metadata: dict | None) -> CheckpointRow:
        key = self.checkpoint_key(path)
        if not self.artifacts.exists(key):
            # The engine reported success but the artifact is gone (deleted or swept meanwhile):
            # fail the save rather than register a checkpoint without files.
            raise ServerError(f"checkpoint {path} was written but its files are missing; save it again")
        size = self.artifacts.size(key)
        now = utcnow()
        row = CheckpointRow(
            tinker_path=str(path), model_id=path.model_id, checkpoint_type=SEGMENT_TYPES[path.segment],
            name=path.name, dir_path=key, created_at=now,
            expires_at=now + timedelta(seconds=ttl_seconds) if ttl_seconds else None, size_bytes=size,
            public=False, user_metadata={str(k): str(v) for k, v in (user_metadata or {}).items()},
        )
        old = self.store.get(CheckpointRow, str(path))
        if old is not None:  # overwrite=True replaces the registration: the old files' storage ends
            self.storage.removed(old, now)
            self.store.delete(CheckpointRow, str(path))
        self.store.add(row)
        return row

    def checkpoint_exists(self, path: TinkerPath) -> bool:
        try:
            self.checkpoint(path)
            return True
        except NotFoundError:
            return False

    def list_checkpoints(self, model_id: str | None = None, checkpoint_type: str | None = None,
                         limit: int | None = None, offset: int = 0, account_id: str | None = None,
                         project_id: str | None = None) -> tuple[list[CheckpointRow], int]:
        """A page of live checkpoints (of one account, or all), newest first, and how many there are in all."""
        return self.checkpoints.page(utcnow(), model_id, checkpoint_type, limit, offset, account_id, project_id)

    def last_checkpoint(self, model_id: str, checkpoint_type: str) -> CheckpointRow | None:
        """The newest live checkpoint of a type (no sweep: a listing of runs asks this per run)."""
        return self.checkpoints.newest(model_id, checkpoint_type, utcnow())

    def delete_checkpoint(self, path: TinkerPath, account_id: str | None = None) -> None:
        row = self.owned_checkpoint(path, account_id)
        self._remove(row)
        self._audit_checkpoint("checkpoint_deleted", row)

    def set_ttl(self, path: TinkerPath, ttl_seconds: int | None, account_id: str | None = None) -> CheckpointRow:
        """Expire `ttl_seconds` from now; None removes the expiry."""
        row = self.owned_checkpoint(path, account_id)
        ttl = check_ttl(ttl_seconds)
        expires_at = utcnow() + timedelta(seconds=ttl) if ttl is not None else None
        self.store.update(CheckpointRow, row.tinker_path, expires_at=expires_at)
        return self.checkpoint(path)

    def set_public(self, path: TinkerPath, public: bool, account_id: str | None = None) -> None:
        row = self.owned_checkpoint(path, account_id)
        self.store.update(CheckpointRow, row.tinker_path, public=public)
        self._audit_checkpoint("checkpoint_published" if public else "checkpoint_unpublished", row)

    def _audit_checkpoint(self, event: str, row: CheckpointRow, **details) -> None:
        run = self.store.get(TrainingRunRow, row.model_id)
        owner = self.account_of(run.session_id) if run is not None else None
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

    def _remove(self, row: CheckpointRow) -> None:
        self.storage.removed(row)
        self.store.delete(CheckpointRow, row.tinker_path)
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

    # -- sampling sessions -----------------------------------------------------------------------

    def create_sampling_session(self, session_id: str, seq_id: int, base_model: str, model_path: str | None,
                                adapter_dir: str | None, account_id: str | None = None,
                                accepted: bool = False, inflight_of: str | None = None) -> SamplingSession:
        """accepted=True: the sampler an accepted op made (save_weights_for_sampler's ephemeral one),
        which spends the free-space reserve; otherwise a new sampler is new work, refused under it
        (a re-send of one already made is not)."""
        self.owned_session(session_id, account_id)
        sid = f"{session_id}:sample:{seq_id}"
        if not accepted and self.reserve is not None and self.samplers.get(sid) is None:
            self.reserve.check()
        row = SamplingSession(sampling_session_id=sid, session_id=session_id, base_model=base_model,
                              model_path=model_path, adapter_dir=adapter_dir, created_at=utcnow(),
                              clients_joined=None, inflight_of=inflight_of)
        if not self.samplers.add(row):
            return self.sampling_session(sid)
        return row

    def sampling_session(self, sampling_session_id: str) -> SamplingSession:
        return self._lookup(self.samplers.get, sampling_session_id, "sampling_session_id")

    def owned_sampling_session(self, sampling_session_id: str, account_id: str | None) -> SamplingSession:
        return self._lookup(self.samplers.get, sampling_session_id, "sampling_session_id", account_id)

    def join_sampling_session(self, sampling_session_id: str, account_id: str | None) -> int:
        """A new client id of the sampling session, unique among its clients: 1, 2, ... (0 is the
        original client). Counted in one write transaction, so concurrent joiners never share one."""
        self.owned_sampling_session(sampling_session_id, account_id)
        return self.samplers.join(sampling_session_id)

    def ephemeral_key(self, sampling_session_id: str) -> str:
        """The artifact key of an ephemeral sampler's weights (save_weights_and_get_sampling_client)."""
        return join(EPHEMERAL, sampling_session_id)

    def prune_ephemeral_samplers(self, session_id: str, keep: int, busy: Callable[[str], bool]) -> list[str]:
        """Delete the session's ephemeral samplers (save_weights_and_get_sampling_client) older than
        its newest `keep`, except ones a queued or decoding request uses; returns the deleted ids.

        Run on the control worker after each new one, so `busy` is exact and no request is admitted
        meanwhile; one spared as busy goes at the next call. The row goes first: from then on a
        request for it is a 404 rather than a sample from missing files. (A request that read the
        row just before, and is not queued yet, fails at admission: the files are gone.) A decoding
        request holds its weights in memory, so deleting files under it is safe.
        """
        rows = self.samplers.ephemeral_of_session(session_id)
        ephemeral = [r for r in rows if _parent(r.adapter_dir) == EPHEMERAL]
        # `<session>:sample:<n>`, n counting up in creation order (shared with named samplers).
        ephemeral.sort(key=lambda r: int(r.sampling_session_id.rsplit(":", 1)[-1]))
        deleted = []
        for row in ephemeral[: max(0, len(ephemeral) - keep)]:
            if busy(row.sampling_session_id):
                continue
            self.samplers.delete(row.sampling_session_id)
            self.artifacts.delete(key_of_path(row.adapter_dir))
            deleted.append(row.sampling_session_id)
        return deleted


def _expired(row: CheckpointRow, now: datetime) -> bool:
    return row.expires_at is not None and row.expires_at <= now


def iso(dt: datetime | None) -> str | None:
    return None if dt is None else dt.strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class CheckpointSweeper:
    """A daemon thread that removes expired checkpoints every `interval_s`, so their disk space comes
    back even when nobody lists or opens them, and clears temporary debris of crashed saves.

    Policy: expiry is exact for the API (lookups and listings treat an expired row as gone at once);
    the sweeper alone deletes, off every request path, and bounds how long the files of an expired
    checkpoint stay on disk, to `interval_s`.
    """

    def __init__(self, runs: Runs, interval_s: float):
        self.runs = runs
        self.interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="tinkerd-checkpoint-sweeper", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _loop(self) -> None:
        while True:
            try:
                removed = self.runs.sweep_expired()
                if removed:
                    log.info("removed %d expired checkpoint(s)", removed)
                self.runs.sweep_stale_temp()
            except Exception:  # a failed sweep must not end the thread; the next one retries
                log.exception("checkpoint sweep failed")
            if self._stop.wait(self.interval_s):
                return
