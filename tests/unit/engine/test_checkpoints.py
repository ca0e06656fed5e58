"""Checkpoint files: PEFT key layout, canonical optimizer order, atomic replace, plain PEFT dirs."""

from __future__ import annotations

import io
import os
import zipfile

import numpy as np
import pytest
import torch
from peft import LoraConfig, get_peft_model
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from tinkerd.engine import checkpoints
from tinkerd.errors import ServerError
from tinkerd.types import (AdamParams, CreateModelOp, Datum, ForwardBackwardOp, LoadWeightsOp, LoraSpec, OptimStepOp,
                           SaveWeightsOp)

BASE = "tinkerd/tiny-qwen3"


@pytest.fixture(scope="module")
def trained(engine) -> str:
    """rank 4, every target, one optim step taken (so optimizer state exists for every tensor)."""
    ops = [
        CreateModelOp("ckpt-model", BASE, LoraSpec(rank=4, alpha=16.0, seed=21)),
        ForwardBackwardOp("ckpt-model", [Datum(np.arange(1, 7), {"target_tokens": np.arange(2, 8)})], "cross_entropy"),
        OptimStepOp("ckpt-model", AdamParams(learning_rate=1e-2)),
    ]
    for result in engine.run_ops(ops):
        assert not isinstance(result, Exception), result
    return "ckpt-model"


def test_files_use_peft_keys_and_canonical_optimizer_order(engine, trained, tmp_path):
    adapter = engine.runtime(BASE).pool.get(trained)
    (result,) = engine.run_ops([SaveWeightsOp(trained, str(tmp_path / "c"), with_optimizer=True)])
    assert not isinstance(result, Exception), result

    tensors = load_file(tmp_path / "c" / checkpoints.WEIGHTS_FILE)
    assert len(tensors) == 2 * len(adapter.weights) == 30
    a = tensors["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"]
    b = tensors["base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"]
    assert a.shape == (4, 64) and b.shape == (64, 4)
    assert tensors["base_model.model.lm_head.lora_B.weight"].shape == (151_669, 4)
    assert torch.equal(tensors["base_model.model.lm_head.lora_A.weight"], adapter.weights["lm_head"][0].detach())

    state = torch.load(tmp_path / "c" / checkpoints.OPTIMIZER_FILE, weights_only=True)
    canonical = [t for name in sorted(adapter.weights) for t in adapter.weights[name]]
    assert state["param_groups"][0]["params"] == list(range(30))
    for j, param in enumerate(canonical):
        assert torch.equal(state["state"][j]["exp_avg"], adapter.optimizer.state[param]["exp_avg"])

    files = checkpoints.read_adapter(tmp_path / "c")
    assert (files.spec, files.step, files.base_model) == (adapter.spec, 1, BASE)


def test_a_checkpoint_of_the_foreach_kernel_resumes_on_this_versions_kernel(engine, trained, tmp_path):
    """Older tinkerd ran AdamW with `foreach` and its optimizer.pt says so; torch's load_state_dict
    would bring that flag back. A run resumed from such a checkpoint must step exactly as one resumed
    from this version's own (the fused kernel differs from foreach in the last bit)."""
    (result,) = engine.run_ops([SaveWeightsOp(trained, str(tmp_path / "new"), with_optimizer=True)])
    assert not isinstance(result, Exception), result
    (tmp_path / "old").mkdir()
    for f in (tmp_path / "new").iterdir():
        (tmp_path / "old" / f.name).write_bytes(f.read_bytes())
    state = torch.load(tmp_path / "old" / checkpoints.OPTIMIZER_FILE, weights_only=True)
    assert state["param_groups"][0]["fused"] is True  # what this version writes
    state["param_groups"][0].update(fused=None, foreach=True)
    torch.save(state, tmp_path / "old" / checkpoints.OPTIMIZER_FILE)

    datum = Datum(np.arange(3, 12), {"target_tokens": np.arange(4, 13)})
    for name in ("new", "old"):
        ops = [LoadWeightsOp(f"kernel-{name}", BASE, str(tmp_path / name), with_optimizer=True),
               ForwardBackwardOp(f"kernel-{name}", [datum], "cross_entropy"),
               OptimStepOp(f"kernel-{name}", AdamParams(learning_rate=1e-2))]
        for result in engine.run_ops(ops):
            assert not isinstance(result, Exception), result
    pool = engine.runtime(BASE).pool
    new, old = pool.get("kernel-new"), pool.get("kernel-old")
    assert old.optimizer.param_groups[0]["fused"] is True
    for name in new.weights:
        for a, b in zip(new.weights[name], old.weights[name]):
            assert torch.equal(a, b), name


def test_a_failed_save_leaves_the_old_checkpoint_and_no_debris(engine, trained, tmp_path, monkeypatch):
    target = tmp_path / "ckpt"
    (ok,) = engine.run_ops([SaveWeightsOp(trained, str(target), with_optimizer=False)])
    assert not isinstance(ok, Exception)
    before = {p.name: p.read_bytes() for p in target.iterdir()}

    def crash(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(checkpoints.torch, "save", crash)
    (failed,) = engine.run_ops([SaveWeightsOp(trained, str(target), with_optimizer=True)])
    assert isinstance(failed, ServerError)
    assert {p.name: p.read_bytes() for p in target.iterdir()} == before
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]  # no temporary directory left behind

    monkeypatch.undo()
    (replaced,) = engine.run_ops([SaveWeightsOp(trained, str(target), with_optimizer=True)])
    assert not isinstance(replaced, Exception)
    assert (target / checkpoints.OPTIMIZER_FILE).is_file()
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]


def test_reads_a_plain_peft_adapter_directory(tiny_runtime, tiny_model_dir, tmp_path):
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    # init_lora_weights=False: random B, so equal tensors below mean the right tensors were read.
    targets = ["q_proj", "v_proj", "lm_head"]
    config = LoraConfig(r=4, lora_alpha=8, target_modules=targets, lora_dropout=0.0, init_lora_weights=False)
    peft_model = get_peft_model(base, config)
    peft_model.save_pretrained(tmp_path / "peft")

    files = checkpoints.read_adapter(tmp_path / "peft")
    assert files.spec == LoraSpec(rank=4, alpha=8.0, train_attn=True, train_mlp=False, train_unembed=True)
    assert files.optimizer_state is None and files.step == 0
    attn = [f"model.layers.{i}.self_attn.{p}" for i in (0, 1) for p in ("q_proj", "v_proj")]
    assert sorted(files.weights) == sorted(["lm_head", *attn])
    inner = peft_model.base_model.model
    for name, (a, b) in files.weights.items():
        assert torch.equal(a, inner.get_submodule(name).lora_A["default"].weight.detach())
        assert torch.equal(b, inner.get_submodule(name).lora_B["default"].weight.detach())
    # The sampler's path: the tensors attach to the shared base as a frozen adapter.
    adapter = tiny_runtime.pool.create_from_tensors("peft-import", files.spec, files.weights, trainable=False)
    assert adapter.optimizer is None
    tiny_runtime.pool.remove("peft-import")


def test_a_save_that_runs_out_of_disk_names_the_disk_and_leaves_no_files(engine, trained, tmp_path):
    """On a real full filesystem (a 16 MiB tmpfs; the rank-4 state with its AdamW moments is 7.4 MB),
    torch.save used to fail as "[enforce fail at inline_container.cc] unexpected pos": the error must
    name the disk, and neither the target nor a temporary directory may be left."""
    from tests.tmpfs import fill, small_tmpfs

    with small_tmpfs(tmp_path / "disk", "16m") as disk:
        (ok,) = engine.run_ops([SaveWeightsOp(trained, str(disk / "ckpts" / "old"), with_optimizer=True)])
        assert not isinstance(ok, Exception), ok
        before = {p.name: p.read_bytes() for p in (disk / "ckpts" / "old").iterdir()}
        fill(disk / "ballast", leave_bytes=8192)
        for name in ("new", "old"):  # a new checkpoint, and an overwrite of an existing one
            (failed,) = engine.run_ops([SaveWeightsOp(trained, str(disk / "ckpts" / name), with_optimizer=True)])
            assert isinstance(failed, ServerError) and failed.category == "server", failed
            assert "disk is full" in failed.message and f"free of 16.8 MB on {disk}" in failed.message, failed.message
            assert sorted(os.listdir(disk / "ckpts")) == ["old"]  # no temporary directory, no half 'new'
        assert {p.name: p.read_bytes() for p in (disk / "ckpts" / "old").iterdir()} == before
        (disk / "ballast").unlink()
        (again,) = engine.run_ops([SaveWeightsOp(trained, str(disk / "ckpts" / "new"), with_optimizer=True)])
        assert not isinstance(again, Exception), again


def test_a_snapshot_serialised_into_the_reused_staging_buffer_is_the_same_bytes(engine, trained):
    """SnapshotWriter serialises optimizer.pt into one kept buffer (checkpoints.Staging): each use
    gives exactly the bytes torch.save into a fresh BytesIO gives (without the zip's CRC-32s, which
    a snapshot skips), also after a bigger one left more bytes in the buffer, and every other file
    is unchanged."""
    adapter = engine.runtime(BASE).pool.get(trained)
    staging = checkpoints.Staging()
    with_opt = checkpoints.capture(adapter, BASE, with_optimizer=True)
    with checkpoints._without_crc32():
        want = with_opt.files()
    small = checkpoints.Captured(with_opt.tensors, with_opt.config, with_opt.meta,
                                 {"state": {}, "param_groups": with_opt.optimizer_state["param_groups"]})
    for captured in (with_opt, small, with_opt):
        got = captured.files(staging)
        with checkpoints._without_crc32():
            expected = want if captured is with_opt else captured.files()
        assert set(got) == set(expected)
        for name in expected:
            assert bytes(got[name]) == bytes(expected[name]), name
    assert len(bytes(small.files(staging)[checkpoints.OPTIMIZER_FILE])) < len(want[checkpoints.OPTIMIZER_FILE])


def test_a_snapshot_without_crcs_loads_whole_and_a_checkpoint_after_it_keeps_its_crcs(engine, trained):
    """A recovery snapshot's optimizer.pt is written without the zip's CRC-32s (~40% of its
    serialising): torch.load reads it to the same state; the setting is the process's, so a user's
    checkpoint serialised after it must have its CRCs again (what zipfile and unzip check)."""
    adapter = engine.runtime(BASE).pool.get(trained)
    captured = checkpoints.capture(adapter, BASE, with_optimizer=True)
    snapshot = bytes(captured.files(checkpoints.Staging())[checkpoints.OPTIMIZER_FILE])
    assert zipfile.ZipFile(io.BytesIO(snapshot)).testzip() is not None  # a record whose CRC is not there
    loaded = torch.load(io.BytesIO(snapshot), weights_only=True)
    want = captured.optimizer_state
    assert loaded["param_groups"] == want["param_groups"]
    assert loaded["state"].keys() == want["state"].keys()
    for i, s in want["state"].items():
        for k, v in s.items():
            assert torch.equal(loaded["state"][i][k], v) if isinstance(v, torch.Tensor) else loaded["state"][i][k] == v
    user = captured.files()[checkpoints.OPTIMIZER_FILE]
    assert zipfile.ZipFile(io.BytesIO(user)).testzip() is None
