"""Releasing adapters (ReleaseAdaptersOp): a training adapter is snapshotted, then unloaded, and
restores from that snapshot to the same weights, optimizer state and step; a sampler adapter a
decoding request holds stays."""

from __future__ import annotations

from tests.unit.engine.test_training import (
    BASE, adapter_of, assert_identical, busy, create, run, sft_data, snapshot, train_step,
)
from tinkerd.engine import checkpoints
from tinkerd.types import ForwardBackwardOp, LoadWeightsOp, LoraSpec, ReleaseAdaptersOp


def test_a_released_adapter_is_snapshotted_unloaded_and_restores_exactly(engine, tmp_path):
    busy(engine, "rel-a", seed=4)  # trained once, with pending grads from a later forward_backward
    before = snapshot(adapter_of(engine, "rel-a"))
    optimizer_before = checkpoints._canonical_optimizer_state(adapter_of(engine, "rel-a"))
    slots = len(engine.runtime(BASE).pool.adapters)
    snap = tmp_path / "rel-a" / "seq-000000000002"

    result = run(engine, ReleaseAdaptersOp(models=[("rel-a", str(snap)), ("never-loaded", None)]))

    assert result == {"unloaded": ["rel-a", "never-loaded"], "sampler_paths": []}
    assert "rel-a" not in engine.model_of and len(engine.runtime(BASE).pool.adapters) == slots - 1
    assert engine.resident().training == sum(a.trainable for a in engine.runtime(BASE).pool.adapters.values())
    run(engine, LoadWeightsOp("rel-a", BASE, str(snap), with_optimizer=True))
    after = snapshot(adapter_of(engine, "rel-a"))
    # Grads are not in a snapshot (control replays the forward_backward calls after it).
    before["grads"] = after["grads"] = None
    before["pending_grads"] = after["pending_grads"] = 0
    # The restored optimizer lists its tensors in canonical order; compare both in that order.
    assert_identical(optimizer_before, checkpoints._canonical_optimizer_state(adapter_of(engine, "rel-a")))
    assert_identical(before["weights"], after["weights"])
    assert before["step"] == after["step"] == 1


def test_an_existing_snapshot_is_not_rewritten_and_training_continues(engine, tmp_path):
    create(engine, "rel-b", seed=5)
    train_step(engine, "rel-b", sft_data(5))
    snap = tmp_path / "seq-000000000002"
    snap.mkdir()  # stands for the snapshot the optim_step already wrote
    run(engine, ReleaseAdaptersOp(models=[("rel-b", str(snap))]))
    assert list(snap.iterdir()) == []
    assert "rel-b" not in engine.model_of


def test_a_sampler_adapter_in_use_is_kept(engine, tmp_path):
    create(engine, "rel-src", seed=6)
    path = tmp_path / "sampler"
    checkpoints.save_adapter(adapter_of(engine, "rel-src"), BASE, path, with_optimizer=False)
    pool = engine.runtime(BASE).pool
    files = checkpoints.read_adapter(path)
    held = pool.create_from_tensors(str(path), LoraSpec(rank=files.spec.rank, alpha=files.spec.alpha), files.weights,
                                    trainable=False)
    pool.acquire(str(path))
    assert run(engine, ReleaseAdaptersOp(sampler_paths=[str(path)]))["sampler_paths"] == []
    assert str(path) in engine.resident().sampler_paths
    pool.release(held)
    assert run(engine, ReleaseAdaptersOp(sampler_paths=[str(path)]))["sampler_paths"] == [str(path)]
    assert str(path) not in engine.resident().sampler_paths
    run(engine, ForwardBackwardOp("rel-src", sft_data(6), "cross_entropy"))  # the training adapter is untouched
