"""Recovery snapshots after an optim_step are written in the background (engine/snapshots.py): the
op returns before the write, the snapshot is the state right after its own step whatever the
adapter does meanwhile, and a release of the same run waits for the write instead of racing it.

The store's put is held on an Event (a gate around the real LocalArtifactStore), so "the write is
still in flight" is a fact of the test, not a timing guess."""

from __future__ import annotations

import threading

import pytest

from tests.unit.engine.test_training import ADAM, BASE, adapter_of, create, run, sft_data, train_step
from tinkerd.artifacts import LocalArtifactStore
from tinkerd.engine import checkpoints
from tinkerd.engine.snapshots import SnapshotWriter
from tinkerd.types import ForwardBackwardOp, OptimStepOp, ReleaseAdaptersOp, StepBatch

# Long enough for a rank-8 tiny-model step on a loaded machine; a synchronous write would hold
# the op on the gate for all of it.
TIMEOUT_S = 60


class GatedStore(LocalArtifactStore):
    """The real local store whose puts wait until `gate` is set."""

    def __init__(self, root):
        super().__init__(root)
        self.gate = threading.Event()
        self.entered = threading.Event()
        self.puts: list[str] = []

    def put(self, key, files):
        self.entered.set()
        assert self.gate.wait(TIMEOUT_S), "the test never opened the gate"
        self.puts.append(key)
        return super().put(key, files)


@pytest.fixture
def gated(engine, tmp_path):
    store = GatedStore("/")
    before, engine.snapshots = engine.snapshots, SnapshotWriter(store)
    yield store
    store.gate.set()
    engine.snapshots.close()
    engine.snapshots = before


def _in_thread(fn) -> threading.Thread:
    t = threading.Thread(target=fn, daemon=True)
    t.start()
    return t


def test_an_optim_step_returns_before_its_snapshot_is_written_and_the_snapshot_is_its_state(engine, gated, tmp_path):
    create(engine, "snap-a", seed=3)
    run(engine, ForwardBackwardOp("snap-a", sft_data(3), "cross_entropy"))
    key = str(tmp_path / "snap-a" / "seq-000000000002")
    step = _in_thread(lambda: run(engine, OptimStepOp("snap-a", ADAM, snapshot_dir=key)))
    step.join(TIMEOUT_S)
    assert not step.is_alive(), "the optim_step waited for its snapshot's write"
    assert gated.entered.wait(TIMEOUT_S) and not (tmp_path / "snap-a" / "seq-000000000002").exists()
    # What a synchronous save right after the step writes, byte for byte (a snapshot's optimizer.pt
    # has no CRC-32s: checkpoints._without_crc32).
    with checkpoints._without_crc32():
        expected = checkpoints.adapter_files(adapter_of(engine, "snap-a"), BASE, with_optimizer=True)

    train_step(engine, "snap-a", sft_data(4))  # moves weights and moments in place while the write waits
    gated.gate.set()
    engine.snapshots.wait()

    assert {name: gated.read(key, name) for name in gated.names(key)} == expected
    assert checkpoints.read_adapter(key).step == 1


def test_a_release_waits_for_the_snapshot_in_flight_and_does_not_write_it_twice(engine, gated, tmp_path):
    create(engine, "snap-b", seed=5)
    run(engine, ForwardBackwardOp("snap-b", sft_data(5), "cross_entropy"))
    key = str(tmp_path / "snap-b" / "seq-000000000002")
    run(engine, OptimStepOp("snap-b", ADAM, snapshot_dir=key))  # returns with the write held on the gate
    assert gated.entered.wait(TIMEOUT_S)
    release = _in_thread(lambda: run(engine, ReleaseAdaptersOp(models=[("snap-b", key)])))
    release.join(0.5)
    assert release.is_alive(), "the release went ahead of the snapshot it unloads on"
    gated.gate.set()
    release.join(TIMEOUT_S)
    assert not release.is_alive() and "snap-b" not in engine.model_of
    assert gated.puts == [key]
    assert checkpoints.read_adapter(key).step == 1


def test_the_steps_report_what_the_snapshots_took(engine, gated, tmp_path):
    """StepOutput.snapshot_s, which control keeps within --snapshot-budget (control/recovery.py):
    the copy in the optim_step's own step, the background write's CPU in a later one; nothing in a
    step without snapshots."""
    create(engine, "snap-c", seed=7)
    run(engine, ForwardBackwardOp("snap-c", sft_data(6), "cross_entropy"))
    engine.snapshots.take_spent()
    quiet = engine.step(StepBatch(run=[("t0", OptimStepOp("snap-c", ADAM))]))
    assert quiet.snapshot_s == 0.0
    run(engine, ForwardBackwardOp("snap-c", sft_data(7), "cross_entropy"))
    key = str(tmp_path / "snap-c" / "seq-000000000004")
    own = engine.step(StepBatch(run=[("t1", OptimStepOp("snap-c", ADAM, snapshot_dir=key))]))
    assert own.snapshot_s > 0  # the copy
    gated.gate.set()
    engine.snapshots.wait()
    later = engine.step(StepBatch())
    assert later.snapshot_s > 0  # the write
    assert engine.step(StepBatch()).snapshot_s == 0.0


def test_a_snapshot_is_serialised_on_the_step_and_only_written_beside_the_next(engine, gated, tmp_path, monkeypatch):
    """The serialisers hold the GIL for tens of ms, which a pass with Python autograd nodes
    (engine/lora/fused.py) would wait on: they run in the optim_step's own thread, and the
    background thread gets bytes to write."""
    threads = []
    files = checkpoints.Captured.files
    monkeypatch.setattr(checkpoints.Captured, "files",
                        lambda self, *a, **k: threads.append(threading.current_thread()) or files(self, *a, **k))
    create(engine, "snap-s", seed=5)
    run(engine, ForwardBackwardOp("snap-s", sft_data(3), "cross_entropy"))
    key = str(tmp_path / "snap-s" / "seq-000000000002")
    run(engine, OptimStepOp("snap-s", ADAM, snapshot_dir=key))
    assert threads == [threading.current_thread()]
    assert gated.entered.wait(TIMEOUT_S)
    gated.gate.set()
    engine.snapshots.wait()
    assert checkpoints.read_adapter(key).step == 1
