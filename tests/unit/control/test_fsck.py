"""`tinkerd fsck` on a hand-made broken data directory: each kind of problem is found, --repair removes
the debris (and puts a set-aside checkpoint back) and leaves every registered checkpoint alone; on
the default SQLite store and on a real PostgreSQL one (`--db-url`, tests/postgres.py) alike."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
from tinker import types as t

from tinkerd.artifacts import LocalArtifactStore
from tinkerd.cli import fsck as cli_fsck
from tinkerd.cli.main import main
from tinkerd.control import fsck
from tinkerd.control.ids import TinkerPath
from tinkerd.control.runs import Runs
from tinkerd.control.store.db import Store, utcnow
from tinkerd.control.store.tables import FutureRow, FutureWatermarkRow, SamplingSessionRow
from tinkerd.engine import checkpoints


def test_file_names_are_the_engines():
    assert (fsck.WEIGHTS_FILE, fsck.CONFIG_FILE, fsck.META_FILE, fsck.OPTIMIZER_FILE) == (
        checkpoints.WEIGHTS_FILE, checkpoints.CONFIG_FILE, checkpoints.META_FILE, checkpoints.OPTIMIZER_FILE)


def _files(d: Path, names=fsck.SNAPSHOT_FILES) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    for name in names:
        (d / name).write_bytes(b"x" * 10)
    return d


def _pending(store: Store, request_id: str, request_type: str, target: str, body: bytes, seq_id: int = 1) -> None:
    store.add(FutureRow(request_id=request_id, request_type=request_type, target=target, seq_id=seq_id,
                        body=body, status="pending", created_at=utcnow()))


def _complete(store: Store, request_id: str, request_type: str, target: str, seq_id: int) -> None:
    store.add(FutureRow(request_id=request_id, request_type=request_type, target=target, seq_id=seq_id,
                        body=b"{}", status="complete", created_at=utcnow(), completed_at=utcnow()))


@pytest.fixture(params=["sqlite", "postgresql"])
def backend(request, tmp_path) -> tuple[str, list[str]]:
    """The store's URL and the flags that name it to `tinkerd fsck`: the data directory's own SQLite
    file (no flag), or a fresh database on the test PostgreSQL (--db-url)."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'tinkerd.sqlite'}", []
    from tests.postgres import fresh_database

    url = fresh_database(request.getfixturevalue("pg_server_url"))
    return url, ["--db-url", url]


@pytest.fixture
def data(tmp_path, backend):
    """A data directory whose store and files agree: two runs, checkpoints of every type, a usable
    snapshot, an ephemeral sampler and a pending op that parses."""
    store = Store(backend[0])
    runs = Runs(store, LocalArtifactStore(tmp_path))
    session = runs.sessions.create_session([], {}, "test")
    run = runs.training_runs.create_run(session, 0, "tiny", {"rank": 4}, {})[0].model_id
    other = runs.training_runs.create_run(session, 1, "tiny", {"rank": 4}, {})[0].model_id
    for segment, name, names in (("weights", "keep", fsck.REQUIRED_FILES["training"]),
                                 ("sampler_weights", "s", fsck.REQUIRED_FILES["sampler"]),
                                 ("external_weights", "e", fsck.REQUIRED_FILES["external"])):
        path = TinkerPath(run, segment, name)
        _files(runs.artifacts.path(runs.checkpoints.checkpoint_key(path)), names)
        runs.checkpoints.register_checkpoint(path, None, None)
    sid = f"{session}:sample:0"
    runs.sampling_sessions.create_sampling_session(session, 0, "tiny", None, str(_files(runs.artifacts.path(runs.sampling_sessions.ephemeral_key(sid)))))
    _complete(store, "req-create", "CreateModel", run, 0)
    _complete(store, "req-optim", "OptimStep", run, 2)
    _files(tmp_path / "snapshots" / run / "seq-000000000002")
    body = t.OptimStepRequest(adam_params=t.AdamParams(learning_rate=1e-2), model_id=run, seq_id=3).model_dump_json()
    _pending(store, "req-ok", "OptimStep", run, body.encode(), 3)
    return tmp_path, store, runs, run, other, session


def _check(data_dir: Path, store: Store) -> fsck.Report:
    return fsck.Fsck(store, data_dir, parse_body=cli_fsck.parse_body).check()


def test_a_consistent_data_dir_is_clean(data, backend, capsys):
    data_dir, store, *_ = data
    report = _check(data_dir, store)
    assert report.clean, [p.line() for p in report.problems]
    assert (report.checkpoints, report.runs, report.snapshots, report.pending) == (3, 2, 1, 1)
    assert main(["fsck", "--data-dir", str(data_dir), *backend[1]]) == 0
    assert "clean (3 checkpoints, 2 runs, 1 snapshots, 1 pending ops)" in capsys.readouterr().out


def test_each_kind_of_problem_is_found_and_repair_removes_only_debris(data, backend, capsys):
    data_dir, store, runs, run, other, session = data
    ck = data_dir / "checkpoints" / run
    # Registered, then damaged from outside: not debris, never touched by repair.
    gone = TinkerPath(run, "weights", "gone")
    _files(runs.artifacts.path(runs.checkpoints.checkpoint_key(gone)), fsck.REQUIRED_FILES["training"])
    runs.checkpoints.register_checkpoint(gone, None, None)
    for f in runs.artifacts.path(runs.checkpoints.checkpoint_key(gone)).iterdir():
        f.unlink()
    runs.artifacts.path(runs.checkpoints.checkpoint_key(gone)).rmdir()
    (ck / "sampler_weights" / "s" / fsck.META_FILE).unlink()  # incomplete
    with open(ck / "external_weights" / "e" / fsck.WEIGHTS_FILE, "ab") as f:  # size differs from the row's
        f.write(b"more")
    # A save that crashed between its two renames: the registered checkpoint sits set aside.
    aside = TinkerPath(run, "weights", "aside")
    _files(runs.artifacts.path(runs.checkpoints.checkpoint_key(aside)), fsck.REQUIRED_FILES["training"])
    runs.checkpoints.register_checkpoint(aside, None, None)
    (ck / "weights" / ".aside.old-x1").mkdir()
    runs.artifacts.path(runs.checkpoints.checkpoint_key(aside)).rename(ck / "weights" / ".aside.old-x1" / "ckpt")
    # Debris.
    _files(ck / "weights" / "orphan")
    _files(data_dir / "checkpoints" / "_ephemeral" / f"{session}:sample:9")
    _files(ck / "weights" / ".half.tmp-abc", [fsck.WEIGHTS_FILE])
    _files(data_dir / "snapshots" / run / ".seq-000000000004.tmp-q", [fsck.WEIGHTS_FILE])
    _files(data_dir / "models" / ".build-zz", ["config.json"])
    (data_dir / ".url_signing.key.k3y").write_bytes(b"k")
    _files(data_dir / "snapshots" / "sess-gone:train:0" / "seq-000000000001")
    # Recovery's inputs damaged.
    _files(data_dir / "snapshots" / run / "seq-000000000001", [fsck.WEIGHTS_FILE])  # incomplete, not the usable one
    store.add(FutureWatermarkRow(dedupe_prefix=f"ForwardBackward|None|{other}", seq_id=5))  # forgotten, no snapshot
    _complete(store, "req-fb-bare", "ForwardBackward", run, 3)
    store.update(FutureRow, "req-fb-bare", body=b"")  # after the snapshot: replay needs it
    _pending(store, "req-no-run", "OptimStep", "sess-gone:train:3", b"{}")
    _pending(store, "req-garbage", "ForwardBackward", run, b"\xff\xfe not protobuf", 4)
    _pending(store, "req-no-sampler", "Sample", f"{session}:sample:7", b"{}")

    report = _check(data_dir, store)
    found = {(p.kind, Path(p.where).name if "/" in p.where else p.where) for p in report.problems}
    assert found == {
        ("missing-checkpoint", "gone"), ("missing-checkpoint", "aside"), ("incomplete-checkpoint", "s"),
        ("size-mismatch", "e"), ("orphan-checkpoint", "orphan"), ("orphan-sampler", f"{session}:sample:9"),
        ("temp-debris", ".aside.old-x1"), ("temp-debris", ".half.tmp-abc"), ("temp-debris", ".seq-000000000004.tmp-q"),
        ("temp-debris", ".build-zz"), ("temp-debris", ".url_signing.key.k3y"), ("orphan-snapshots", "sess-gone:train:0"),
        ("incomplete-snapshot", "seq-000000000001"), ("unrecoverable-run", other), ("unrecoverable-run", run),
        ("stranded-future", "req-no-run"), ("stranded-future", "req-garbage"), ("stranded-future", "req-no-sampler"),
    }, sorted(found)
    assert {p.kind for p in report.problems if p.debris} == {"orphan-checkpoint", "orphan-sampler", "temp-debris",
                                                              "orphan-snapshots"}

    assert main(["fsck", "--data-dir", str(data_dir), *backend[1], "--repair"]) == 1  # what is not debris stays
    out = capsys.readouterr().out
    assert f"repair: restored {runs.artifacts.path(runs.checkpoints.checkpoint_key(aside))}" in out
    after = _check(data_dir, store)
    assert {p.kind for p in after.problems} == {"missing-checkpoint", "incomplete-checkpoint", "size-mismatch",
                                                "incomplete-snapshot", "unrecoverable-run", "stranded-future"}
    assert not any(p.debris for p in after.problems)
    assert not (ck / "weights" / "orphan").exists() and not (data_dir / "snapshots" / "sess-gone:train:0").exists()
    assert not list(data_dir.rglob(".*.tmp-*")) and not list(data_dir.rglob(".build-*"))
    # Registered checkpoints: untouched (the damaged ones too), the set-aside one back in place.
    assert sorted(p.name for p in runs.artifacts.path(runs.checkpoints.checkpoint_key(aside)).iterdir()) == sorted(fsck.REQUIRED_FILES["training"])
    assert (ck / "weights" / "keep" / fsck.OPTIMIZER_FILE).is_file()
    assert (ck / "sampler_weights" / "s" / fsck.WEIGHTS_FILE).is_file()
    assert (ck / "external_weights" / "e" / fsck.WEIGHTS_FILE).is_file()
    assert (data_dir / "snapshots" / run / "seq-000000000002" / fsck.OPTIMIZER_FILE).is_file()
    assert store.get(SamplingSessionRow, f"{session}:sample:0") is not None


def test_refuses_a_data_dir_a_server_holds(data, backend, capsys):
    data_dir, store, *_ = data
    url, flags = backend
    (data_dir / "checkpoints" / run_dir(data) / "weights" / ".saving.tmp-1").mkdir()  # a save in progress
    # Another process using the store as a server does: the SQLite file open, or (PostgreSQL) a
    # connection of the store's own, named by its application_name.
    opens = (f"import sqlite3; c = sqlite3.connect({str(data_dir / 'tinkerd.sqlite')!r}); c.execute('select 1')"
             if not flags else f"from tinkerd.control.store.db import Store; s = Store({url!r}); s.holders()")
    holder = subprocess.Popen([sys.executable, "-c", f"import time; {opens}; print('open', flush=True); time.sleep(60)"],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "open"
        assert main(["fsck", "--data-dir", str(data_dir), *flags, "--repair"]) == 2
        err = capsys.readouterr().err
        held = f"is open in process {holder.pid}" if not flags else f"pid {holder.pid} (backend"
        assert held in err and "stop it first" in err, err
        assert (data_dir / "checkpoints" / run_dir(data) / "weights" / ".saving.tmp-1").is_dir()  # nothing removed
    finally:
        holder.kill()
        holder.wait()
    for _ in range(100):  # PostgreSQL ends a dead client's session once it notices the socket closed
        if main(["fsck", "--data-dir", str(data_dir), *flags]) != 2:
            break
        time.sleep(0.05)
    assert main(["fsck", "--data-dir", str(data_dir), *flags]) == 1  # once it is gone: the debris is reported


def run_dir(data) -> str:
    return data[3]


def test_no_store_is_an_error(tmp_path, capsys):
    assert main(["fsck", "--data-dir", str(tmp_path / "nothing")]) == 1
    assert "no tinkerd data in" in capsys.readouterr().err
