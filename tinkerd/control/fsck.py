"""Consistency of a stopped server's data directory: the store and the files agree.

`tinkerd fsck` (cli/fsck.py) runs this on a data directory no server holds. What it checks, and why
each can go wrong:

- every registered checkpoint (not expired) has its directory, with the files its
  type must have and, where the row recorded one, the size it had when it was registered. Saves are
  written to a temp name and renamed (engine/checkpoints.py), so only outside hands (a deleted or
  truncated file, a restore from backup) break this;
- no orphans: a checkpoint directory without its row (a crash between the rename and the row, or
  between `_remove`'s row delete and its rmtree), an ephemeral sampler directory without its
  sampling session (prune_ephemeral_samplers deletes the row first), snapshots of a run the store
  does not know;
- no temp debris of a crashed write: `.<name>.tmp-*` and `.<name>.old-*` next to checkpoints and
  snapshots (the local ArtifactStore's put, tinkerd/artifacts.py), `.build-*` in the
  models directory (engine/model/registry.py), `.url_signing.key.*` (api/routes/export.py);
- no stranded future: a pending op is normal for a stopped server (the next start queues it again),
  so what is checked is that it can run then: its target exists and its stored body parses;
- every run can be rebuilt: the snapshot recovery would start from is whole, the logged ops after
  it still have their bodies, and ops the retention sweep forgot lie before that snapshot.

Repair removes debris only (temp directories, orphans) and puts a set-aside checkpoint back when its
real name is empty, as `Checkpoints.sweep_stale_temp` does at start. It never deletes a registered
checkpoint, a snapshot recovery may use, or a row.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from tinkerd.control import inflight
from tinkerd.artifacts import LocalArtifactStore, key_of_path
from tinkerd.control.debris import CHECKPOINT_TEMP, SNAPSHOT_TEMP
from tinkerd.control.recovery import STATE_CHANGING, Recovery, rebuild_work
from tinkerd.control.retention import dedupe_prefix
from tinkerd.control.ids import SEGMENT_TYPES
from tinkerd.control.store.checkpoints import CheckpointRepository
from tinkerd.control.store.db import Store, utcnow
from tinkerd.control.store.futures import FutureRepository
from tinkerd.control.store.runs import RunRepository
from tinkerd.control.store.sampling import SamplingSessionRepository
from tinkerd.control.store.sessions import SessionRepository
from tinkerd.control.store.tables import FutureRow

# The files engine/checkpoints.py writes (control may not import the engine; a unit test checks that
# these names equal engine.checkpoints' own). Exports (external) may be age-encrypted: `<file>.age`.
WEIGHTS_FILE, CONFIG_FILE, META_FILE, OPTIMIZER_FILE = (
    "adapter_model.safetensors", "adapter_config.json", "tinkerd.json", "optimizer.pt")
AGE_SUFFIX = ".age"
REQUIRED_FILES = {
    "training": (WEIGHTS_FILE, CONFIG_FILE, META_FILE, OPTIMIZER_FILE),  # save_state: with_optimizer=True
    "sampler": (WEIGHTS_FILE, CONFIG_FILE, META_FILE),
    "external": (WEIGHTS_FILE, CONFIG_FILE),  # a plain PEFT directory (engine/export.py)
}
SNAPSHOT_FILES = REQUIRED_FILES["training"]  # engine/snapshots.py: write saves with the optimizer
# Temp names of every writer under the data directory, relative to the directory they sit in.
TEMP_PATTERNS = {
    "checkpoints": CHECKPOINT_TEMP,  # named, then _ephemeral (control/debris.py)
    "snapshots": SNAPSHOT_TEMP,  # snapshots/<model_id>/.seq-<n>.tmp-*
    "models": (".build-*", "*/.build-*"),
    ".": (".url_signing.key.*",),
}


@dataclass(frozen=True)
class Problem:
    kind: str
    where: str  # a path, or a request_id / model_id for store problems
    detail: str
    # Debris that --repair removes (or, for a set-aside checkpoint, puts back).
    debris: bool = False

    def line(self) -> str:
        return f"{self.kind}: {self.where}: {self.detail}" + (" [repairable]" if self.debris else "")


@dataclass
class Report:
    problems: list[Problem] = field(default_factory=list)
    checkpoints: int = 0
    snapshots: int = 0
    pending: int = 0
    runs: int = 0

    @property
    def clean(self) -> bool:
        return not self.problems


class Fsck:
    def __init__(self, store: Store, data_dir: Path, parse_body: Callable[[FutureRow], None] | None = None):
        self.store = store
        self.checkpoints = CheckpointRepository(store)
        self.futures = FutureRepository(store)
        self.data_dir = Path(data_dir)
        self.checkpoints_dir = self.data_dir / "checkpoints"
        self.snapshots_dir = self.data_dir / "snapshots"
        self.models_dir = self.data_dir / "models"
        # parse_body(row) raises when a pre-op-log row's wire request no longer decodes (the api layer's
        # codecs, supplied by the caller: control does not parse wire bodies). None skips that check.
        self.parse_body = parse_body
        # fsck checks a stopped server's local data directory: the local store over it (tinkerd/artifacts.py).
        self.recovery = Recovery(store, LocalArtifactStore(self.data_dir))

    # -- checking --------------------------------------------------------------------------------

    def check(self) -> Report:
        report = Report()
        self._checkpoints(report)
        self._orphans(report)
        self._debris(report)
        self._snapshots(report)
        self._pending(report)
        return report

    def _checkpoints(self, report: Report) -> None:
        now = utcnow()
        for row in self.checkpoints.all():
            if row.expires_at is not None and row.expires_at <= now:
                continue  # gone for the API already; the sweeper removes row and files
            report.checkpoints += 1
            d = self._path(row.dir_path)
            if not d.is_dir():
                report.problems.append(Problem("missing-checkpoint", str(d), f"{row.tinker_path} is registered "
                                               "but its directory is missing"))
                continue
            missing = [f for f in REQUIRED_FILES.get(row.checkpoint_type, ())
                       if not (d / f).is_file() and not (d / (f + AGE_SUFFIX)).is_file()]
            if missing:
                report.problems.append(Problem("incomplete-checkpoint", str(d),
                                               f"{row.tinker_path} lacks {', '.join(missing)}"))
                continue
            if row.size_bytes is not None:
                # register_checkpoint recorded the sum of every file's size under the directory.
                size = sum(f.stat().st_size for f in d.rglob("*") if f.is_file())
                if size != row.size_bytes:
                    report.problems.append(Problem("size-mismatch", str(d), f"{row.tinker_path} holds {size} bytes, "
                                                   f"{row.size_bytes} were registered"))

    def _orphans(self, report: Report) -> None:
        if not self.checkpoints_dir.is_dir():
            return
        paths = {r.tinker_path for r in self.checkpoints.all()}
        for model_dir in _dirs(self.checkpoints_dir):
            if model_dir.name == "_ephemeral":
                continue
            for seg_dir in _dirs(model_dir):
                if seg_dir.name not in SEGMENT_TYPES:
                    continue  # not a layout tinkerd writes: left to the operator, never deleted
                for d in _dirs(seg_dir):
                    if f"tinker://{model_dir.name}/{seg_dir.name}/{d.name}" not in paths:
                        report.problems.append(Problem("orphan-checkpoint", str(d), "a checkpoint directory with no "
                                                       "registration (a crash between its write and its row)", True))
        ephemeral = self.checkpoints_dir / "_ephemeral"
        if ephemeral.is_dir():
            # By name: the rows hold absolute paths, and the data directory may be reached another way now.
            rows = SamplingSessionRepository(self.store).with_adapter()
            used = {self._path(r.adapter_dir).name for r in rows if self._path(r.adapter_dir).parent.name == "_ephemeral"}
            used |= inflight.kept_dirs(rows)  # an older inflight save's, kept for requests accepted on it
            for d in _dirs(ephemeral):
                if d.name not in used:
                    report.problems.append(Problem("orphan-sampler", str(d), "an ephemeral sampler directory with no "
                                                   "sampling session", True))

    def _debris(self, report: Report) -> None:
        for where, patterns in TEMP_PATTERNS.items():
            root = self.data_dir / where
            if not root.is_dir():
                continue
            for pattern in patterns:
                for p in sorted(root.glob(pattern)):
                    detail = "a temporary left by a write that never finished"
                    if _set_aside(p) is not None:
                        detail = f"a checkpoint set aside by a save that crashed; repair puts it back at {_target(p)}"
                    report.problems.append(Problem("temp-debris", str(p), detail, True))

    def _snapshots(self, report: Report) -> None:
        runs = {r.model_id: r for r in RunRepository(self.store).all()}
        report.runs = len(runs)
        if self.snapshots_dir.is_dir():
            for d in _dirs(self.snapshots_dir):
                if d.name not in runs:
                    report.problems.append(Problem("orphan-snapshots", str(d), "recovery snapshots of a run the "
                                                   "store does not know", True))
                    continue
                for snap in _dirs(d):
                    report.snapshots += 1
                    missing = [f for f in SNAPSHOT_FILES if not (snap / f).is_file()]
                    if missing:
                        report.problems.append(Problem("incomplete-snapshot", str(snap), f"lacks {', '.join(missing)}"))
        accounts = {s.session_id: s.account_id for s in SessionRepository(self.store).all()}
        for model_id, run in sorted(runs.items()):
            self._rebuildable(report, model_id, accounts.get(run.session_id))

    def _rebuildable(self, report: Report, model_id: str, account_id: str | None) -> None:
        """What Recovery.replay_plan would use for this run is all there."""
        snap = self.recovery.latest_snapshot(model_id)
        seq = -1
        if snap is not None:
            seq, key = snap
            path = self.data_dir / key
            missing = [f for f in SNAPSHOT_FILES if not (path / f).is_file()]
            if missing:
                report.problems.append(Problem("unrecoverable-run", model_id, f"the snapshot recovery starts from, "
                                               f"{path}, lacks {', '.join(missing)}"))
        # Retention forgets a state-changing op only once a usable snapshot lies after it.
        for request_type in STATE_CHANGING:
            mark = self.futures.watermark(dedupe_prefix(request_type, account_id, model_id))
            if mark is not None and mark >= seq:
                report.problems.append(Problem("unrecoverable-run", model_id, f"{request_type} ops up to seq_id "
                                               f"{mark} were forgotten and no usable snapshot follows them"))
        for request_id in self.futures.bodiless_after(model_id, seq, STATE_CHANGING):
            report.problems.append(Problem("unrecoverable-run", model_id, f"op {request_id}, replayed by recovery, "
                                           "has lost its stored request"))

    def _pending(self, report: Report) -> None:
        for row in self.recovery.pending():
            report.pending += 1
            target = row.target.split("#", 1)[0]  # shared targets carry "#<account>" (api/routes/sampling.py)
            if ":train:" in target and RunRepository(self.store).get(target) is None:
                missing = f"training run {target}"
            elif ":sample:" in target and SamplingSessionRepository(self.store).get(target) is None:
                missing = f"sampling session {target}"
            elif target.startswith("tinker://") and self.checkpoints.get(target) is None:
                missing = f"checkpoint {target}"
            else:
                missing = None
            if missing is not None:
                report.problems.append(Problem("stranded-future", row.request_id, f"pending {row.request_type} "
                                               f"targets {missing}, which does not exist"))
                continue
            try:
                if row.op_version is not None:
                    rebuild_work(row)  # an op record: decodes here, as recovery will
                elif self.parse_body is not None:
                    self.parse_body(row)  # pre-op-log: the start's conversion decodes it through the api
            except Exception as e:  # whatever the codec raises: the op cannot be rebuilt at start
                why = getattr(e, "message", None) or f"{type(e).__name__}: {e}"
                report.problems.append(Problem("stranded-future", row.request_id, f"pending {row.request_type} "
                                               f"of {row.target} cannot be rebuilt from its stored body: {why}"))

    def _path(self, stored: str) -> Path:
        """Where a row's artifact (a key, or a path written before keys) lies in this data directory."""
        try:
            return self.data_dir / key_of_path(stored)
        except ValueError:
            return Path(stored)

    # -- repairing -------------------------------------------------------------------------------

    def repair(self, report: Report) -> list[str]:
        """Remove the report's debris; returns one line per action. Registered checkpoints, snapshots
        recovery may use and store rows are never touched."""
        registered = {os.path.realpath(self._path(r.dir_path)) for r in self.checkpoints.all()}
        done = []
        for p in report.problems:
            if not p.debris:
                continue
            path = Path(p.where)
            if os.path.realpath(path) in registered:  # belt and braces: an orphan is by definition unregistered
                continue
            kept = _set_aside(path)
            if kept is not None:
                os.replace(kept, _target(path))
                done.append(f"restored {_target(path)} from {path}")
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            elif path.exists() or path.is_symlink():
                path.unlink()
            else:
                continue
            done.append(f"removed {path}")
        return done


def _dirs(root: Path) -> list[Path]:
    """Subdirectories with real names (temp names start with '.'), sorted."""
    return sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))


def _target(p: Path) -> Path:
    return p.parent / p.name[1:].rsplit(".old-", 1)[0]


def _set_aside(p: Path) -> Path | None:
    """`.<name>.old-*/ckpt` when its real name is empty: the crash came between the two renames of
    the local store's put, so this is the live checkpoint (tinkerd/artifacts.py)."""
    kept = p / "ckpt"
    if ".old-" in p.name and kept.is_dir() and not _target(p).exists():
        return kept
    return None
