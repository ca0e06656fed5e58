"""The checkpoint registry: TTL expiry (lazy and swept), paging, and recovery of crashed saves."""

from __future__ import annotations

import os
import time
from datetime import timedelta

import pytest

from tinkerd.artifacts import LocalArtifactStore
from tinkerd.control.checkpoints import CheckpointSweeper
from tinkerd.control.ids import TinkerPath, check_ttl
from tinkerd.control.runs import Runs
from tinkerd.control.store.db import Store, utcnow
from tinkerd.control.store.tables import CheckpointRow
from tinkerd.errors import NotFoundError, ServerError, StorageUnavailable, UserError


@pytest.fixture
def runs(tmp_path) -> Runs:
    r = Runs(Store.sqlite(tmp_path / "db.sqlite"), LocalArtifactStore(tmp_path))
    session = r.sessions.create_session([], {}, "test")
    r.training_runs.create_run(session, 0, "tiny", {"rank": 4}, {})
    return r


def _model_id(runs: Runs) -> str:
    return runs.training_runs.list_runs()[0][0].model_id


def _saved(runs: Runs, name: str, segment: str = "weights", ttl: int | None = None) -> TinkerPath:
    """What a finished save leaves: the directory in place, then the registration."""
    path = TinkerPath(_model_id(runs), segment, name)
    d = runs.artifacts.path(runs.checkpoints.checkpoint_key(path))
    d.mkdir(parents=True)
    (d / "adapter_model.safetensors").write_bytes(b"x" * 100)
    runs.checkpoints.register_checkpoint(path, ttl, {"k": "v"})
    return path


def _expire(runs: Runs, path: TinkerPath) -> None:
    runs.store.update(CheckpointRow, str(path), expires_at=utcnow() - timedelta(seconds=1))


def test_registration_needs_the_finished_directory(runs):
    path = TinkerPath(_model_id(runs), "weights", "never-written")
    with pytest.raises(ServerError, match="files are missing"):
        runs.checkpoints.register_checkpoint(path, None, None)
    assert runs.checkpoints.list_checkpoints() == ([], 0)


def test_expired_checkpoints_vanish_from_lookups_and_listings_at_once_and_from_disk_by_the_sweep(runs):
    keep, gone = _saved(runs, "keep"), _saved(runs, "gone", ttl=3600)
    assert runs.checkpoints.checkpoint(gone).size_bytes == 100
    _expire(runs, gone)
    with pytest.raises(NotFoundError):
        runs.checkpoints.checkpoint(gone)
    rows, total = runs.checkpoints.list_checkpoints()
    assert [r.tinker_path for r in rows] == [str(keep)] and total == 1
    # A lookup or a listing (a request) never deletes: the files go with the sweep, off every request path.
    assert runs.artifacts.path(runs.checkpoints.checkpoint_key(gone)).is_dir()
    assert runs.checkpoints.sweep_expired() == 1
    assert not runs.artifacts.path(runs.checkpoints.checkpoint_key(gone)).exists()
    assert runs.artifacts.path(runs.checkpoints.checkpoint_key(keep)).is_dir()


def test_a_page_and_its_total_count_only_live_rows(runs):
    paths = [_saved(runs, f"c{i}") for i in range(5)]
    _expire(runs, paths[1])
    rows, total = runs.checkpoints.list_checkpoints(limit=2, offset=0)
    assert total == 4
    assert [r.name for r in rows] == ["c4", "c3"]  # newest first
    assert [r.name for r in runs.checkpoints.list_checkpoints(limit=2, offset=2)[0]] == ["c2", "c0"]
    assert runs.checkpoints.last_checkpoint(_model_id(runs), "training").name == "c4"


def test_sweep_spares_a_newer_save_under_an_expired_name(runs):
    path = _saved(runs, "reused", ttl=3600)
    # The row was created an hour ago and has expired; the directory is a newer save of the same
    # name that has not been registered yet (its finalize is about to run).
    runs.store.update(CheckpointRow, str(path), created_at=utcnow() - timedelta(hours=1),
                      expires_at=utcnow() - timedelta(seconds=1))
    assert runs.checkpoints.sweep_expired() == 1
    assert runs.store.get(CheckpointRow, str(path)) is None
    assert runs.artifacts.path(runs.checkpoints.checkpoint_key(path)).is_dir()
    runs.checkpoints.register_checkpoint(path, None, None)
    assert runs.checkpoints.checkpoint(path).expires_at is None


def test_sweeper_thread_deletes_files_without_any_request(runs):
    path = _saved(runs, "t", ttl=3600)
    sweeper = CheckpointSweeper(runs.checkpoints, interval_s=0.05)
    sweeper.start()
    try:
        _expire(runs, path)
        deadline = time.monotonic() + 5
        while runs.artifacts.path(runs.checkpoints.checkpoint_key(path)).exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not runs.artifacts.path(runs.checkpoints.checkpoint_key(path)).exists()
        assert runs.store.get(CheckpointRow, str(path)) is None
    finally:
        sweeper.stop()


def test_ttl_update_and_removal(runs):
    path = _saved(runs, "ttl")
    row = runs.checkpoints.set_ttl(path, 7200)
    assert timedelta(seconds=7190) < row.expires_at - utcnow() <= timedelta(seconds=7200)
    assert runs.checkpoints.set_ttl(path, None).expires_at is None
    for bad in (0, -5, True, "60", 1.5, 10**10):
        with pytest.raises(UserError):
            check_ttl(bad)
    assert check_ttl(None) is None and check_ttl(1) == 1


def test_crash_debris_is_removed_and_a_set_aside_checkpoint_restored(runs):
    live = _saved(runs, "live")
    parent = runs.artifacts.path(runs.checkpoints.checkpoint_key(live)).parent
    old = time.time() - 7200

    def debris(name: str, inner: str | None = None, mtime: float = old):
        d = parent / name
        (d / inner if inner else d).mkdir(parents=True)
        (d / inner if inner else d).joinpath("adapter_model.safetensors").write_bytes(b"y")
        os.utime(d, (mtime, mtime))
        return d

    half = debris(".half.tmp-abc123")  # a save that never finished
    fresh = debris(".busy.tmp-def456", mtime=time.time())  # maybe a save in progress: kept
    lost = debris(".lost.old-ghi789", "ckpt")  # crash between the two renames: restore
    stale = debris(".live.old-jkl012", "ckpt")  # crash after the swap: the new one is in place
    assert runs.checkpoints.sweep_stale_temp() == 3
    assert not half.exists() and fresh.exists() and not lost.exists() and not stale.exists()
    assert (parent / "lost" / "adapter_model.safetensors").read_bytes() == b"y"
    assert (runs.artifacts.path(runs.checkpoints.checkpoint_key(live)) / "adapter_model.safetensors").read_bytes() == b"x" * 100
    # At start-up nothing can be saving, so age does not matter.
    assert runs.checkpoints.sweep_stale_temp(older_than_s=0) == 1 and not fresh.exists()


class FullDisk:
    """DiskReserve under its reserve (control/diskspace.py)."""

    def check(self) -> None:
        raise StorageUnavailable("server storage is full: 1 MB free on /data, under the 3 MB reserve")


def test_a_new_sampling_session_is_refused_under_the_reserve_but_not_a_resend_or_an_accepted_ops(runs):
    session = runs.training_runs.list_runs()[0][0].session_id
    first = runs.sampling_sessions.create_sampling_session(session, 0, "tiny", None, None)
    runs.refuse_under(FullDisk())
    with pytest.raises(StorageUnavailable, match="server storage is full"):
        runs.sampling_sessions.create_sampling_session(session, 1, "tiny", None, None)
    assert runs.sampling_sessions.create_sampling_session(session, 0, "tiny", None, None).sampling_session_id == first.sampling_session_id
    # save_weights_for_sampler's ephemeral sampler: the op was accepted, so it spends the reserve.
    assert runs.sampling_sessions.create_sampling_session(session, 2, "tiny", None, "/x", accepted=True).adapter_dir == "/x"


def test_a_run_is_touched_at_most_once_a_second_by_one_process(runs, monkeypatch):
    from tinkerd.control import training_runs

    model_id = _model_id(runs)
    writes = []
    set_ = runs.training_runs.training_runs.set
    monkeypatch.setattr(runs.training_runs.training_runs, "set", lambda *a, **k: (writes.append(k), set_(*a, **k)))
    clock = [1000.0]
    monkeypatch.setattr(training_runs.time, "monotonic", lambda: clock[0])
    before = runs.training_runs.run(model_id).last_request_at
    for _ in range(5):  # a burst of requests: one write
        runs.training_runs.touch(model_id)
        clock[0] += 0.1
    assert len(writes) == 1 and runs.training_runs.run(model_id).last_request_at > before
    clock[0] += training_runs.TOUCH_EVERY_S
    runs.training_runs.touch(model_id)
    assert len(writes) == 2
    runs.training_runs.touch("another-target")  # not a run: written through (and nothing found) once
    runs.training_runs.touch("another-target")
    assert len(writes) == 3
