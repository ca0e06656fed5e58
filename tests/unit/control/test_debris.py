"""Crash debris of the atomic writes is swept before every rebuild (server start, engine restart):
snapshot temp dirs and checkpoint temp dirs go, whole snapshots and checkpoints stay byte for byte,
and a copy_weights in progress is left alone."""

from __future__ import annotations

from pathlib import Path

import pytest

from tinkerd.artifacts import LocalArtifactStore
from tinkerd.control.recovery import Recovery
from tinkerd.control.ids import TinkerPath
from tinkerd.control.runs import Runs
from tinkerd.control.store.db import Store


class NoEngine:
    """A fresh engine with nothing to replay: step() is never reached on an empty store."""

    def models(self):  # recovery asks which base models the engine serves (control/recovery.py)
        return []

    def step(self, ops):
        raise AssertionError("nothing to replay")

    def models(self):  # recovery.rebuild_engine asks which base models it serves
        return []


def _dir(path: Path, content: bytes) -> Path:
    path.mkdir(parents=True)
    (path / "adapter_model.safetensors").write_bytes(content)
    return path


@pytest.fixture
def store(tmp_path) -> Store:
    return Store.sqlite(tmp_path / "db.sqlite")


def test_the_rebuild_sweeps_snapshot_temp_dirs_and_keeps_whole_snapshots(store, tmp_path):
    root = tmp_path / "snapshots" / "sess-1:train:0"
    real = _dir(root / "seq-000000000004", b"real")
    half = _dir(root / ".seq-000000000006.tmp-ab12cd34", b"half")  # a snapshot write killed mid-way
    set_aside = _dir(root / ".seq-000000000005.old-ef56gh78" / "ckpt", b"five").parent  # killed between renames
    stale = _dir(root / ".seq-000000000004.old-ij90kl12" / "ckpt", b"older").parent  # killed after the swap
    recovery = Recovery(store, LocalArtifactStore(tmp_path), rebuild=None)
    report = recovery.rebuild_engine(NoEngine())
    assert report.replayed_ops == 0
    assert not half.exists() and not set_aside.exists() and not stale.exists()
    assert (real / "adapter_model.safetensors").read_bytes() == b"real"
    assert (root / "seq-000000000005" / "adapter_model.safetensors").read_bytes() == b"five"  # put back
    assert sorted(p.name for p in root.iterdir()) == ["seq-000000000004", "seq-000000000005"]


def test_the_rebuild_runs_the_checkpoint_sweep_but_spares_a_copy_in_progress(store, tmp_path):
    runs = Runs(store, LocalArtifactStore(tmp_path))
    session = runs.sessions.create_session([], {}, "test")
    model_id = runs.training_runs.create_run(session, 0, "tiny", {"rank": 4}, {})[0].model_id
    saved = TinkerPath(model_id, "weights", "kept")
    ckpt = _dir(tmp_path / runs.checkpoints.checkpoint_key(saved), b"ckpt")
    runs.checkpoints.register_checkpoint(saved, None, None)
    parent = ckpt.parent
    killed = _dir(parent / ".mid.tmp-k1ll3d00", b"half")  # the dead engine's save_state, just now
    sampler = _dir(parent.parent.parent / "_ephemeral" / ".s:sample:1.tmp-0a1b2c3d", b"half")
    recovery = Recovery(store, LocalArtifactStore(tmp_path), rebuild=None)
    recovery.sweeps.append(lambda: runs.checkpoints.sweep_stale_temp(older_than_s=0))  # as cli/serve.py wires it
    seen: list[list[str]] = []

    def copying():  # a copy_weights through the same store, swept in the middle of its write
        yield b"cop"
        recovery.rebuild_engine(NoEngine())
        seen.append(sorted(p.name for p in parent.iterdir()))
        yield b"ying"

    runs.artifacts.put(runs.checkpoints.checkpoint_key(TinkerPath(model_id, "weights", "copy")), {"adapter_model.safetensors": copying()})
    assert not killed.exists() and not sampler.exists()
    assert [name for name in seen[0] if name.startswith(".copy.tmp-")]  # its temp dir outlived the sweep
    assert (parent / "copy" / "adapter_model.safetensors").read_bytes() == b"copying"
    assert (ckpt / "adapter_model.safetensors").read_bytes() == b"ckpt"
    assert runs.checkpoints.checkpoint(saved).size_bytes == 4


def test_a_failing_extra_sweep_does_not_stop_the_rebuild(store, tmp_path):
    recovery = Recovery(store, LocalArtifactStore(tmp_path), rebuild=None)

    def broken():
        raise PermissionError("no")

    recovery.sweeps.append(broken)
    assert recovery.rebuild_engine(NoEngine()).models == 0
