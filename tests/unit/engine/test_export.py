"""save_weights_external files: a plain PEFT adapter, age-encrypted on request, all-or-nothing on disk."""

from __future__ import annotations

import errno
import json
import os

import numpy as np
import pyrage
import pytest
import torch
from safetensors.torch import load, load_file

from tinkerd.engine import checkpoints, export
from tinkerd.errors import ServerError, UserError
from tinkerd.types import AdamParams, CreateModelOp, Datum, ExportWeightsOp, ForwardBackwardOp, LoraSpec, OptimStepOp, SaveWeightsOp

BASE = "tinkerd/tiny-qwen3"
MODEL = "export-model"


@pytest.fixture(scope="module")
def trained(engine) -> str:
    ops = [
        CreateModelOp(MODEL, BASE, LoraSpec(rank=4, alpha=32.0, seed=3)),
        ForwardBackwardOp(MODEL, [Datum(np.arange(1, 7), {"target_tokens": np.arange(2, 8)})], "cross_entropy"),
        OptimStepOp(MODEL, AdamParams(learning_rate=1e-2)),
    ]
    for result in engine.run_ops(ops):
        assert not isinstance(result, Exception), result
    return MODEL


def _run(engine, op):
    (result,) = engine.run_ops([op])
    return result


def test_export_is_a_plain_peft_adapter_with_the_trained_scaling(engine, trained, tmp_path):
    adapter = engine.runtime(BASE).pool.get(trained)
    result = _run(engine, ExportWeightsOp(trained, str(tmp_path / "e")))
    assert not isinstance(result, Exception), result
    assert sorted(os.listdir(tmp_path / "e")) == ["adapter_config.json", "adapter_model.safetensors"]
    assert result["size_bytes"] == sum(f.stat().st_size for f in (tmp_path / "e").iterdir())
    cfg = json.loads((tmp_path / "e" / "adapter_config.json").read_text())
    # PEFT scales by lora_alpha / r; it must be the scaling the adapter trained with.
    assert cfg["r"] == 4 and cfg["lora_alpha"] / cfg["r"] == adapter.spec.scaling == 8.0
    assert cfg["base_model_name_or_path"] == BASE
    tensors = load_file(tmp_path / "e" / "adapter_model.safetensors")
    a, b = adapter.weights["lm_head"]
    assert torch.equal(tensors["base_model.model.lm_head.lora_A.weight"], a.detach())
    assert torch.equal(tensors["base_model.model.lm_head.lora_B.weight"], b.detach())
    assert b.abs().sum() > 0  # trained: B moved away from its zero init
    # Same tensors under the same keys as a training checkpoint of the same state.
    _run(engine, SaveWeightsOp(trained, str(tmp_path / "c"), with_optimizer=True))
    ckpt = load_file(tmp_path / "c" / "adapter_model.safetensors")
    assert ckpt.keys() == tensors.keys() and all(torch.equal(ckpt[k], tensors[k]) for k in ckpt)


def test_encrypted_export_writes_only_age_files_that_decrypt_to_the_plain_export(engine, trained, tmp_path):
    plain = _run(engine, ExportWeightsOp(trained, str(tmp_path / "plain")))
    identity = pyrage.x25519.Identity.generate()
    ssh_recipient = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIGE1lqGSGOa3HDJZLaB+9AF2j3YvcYtjdDoC9SIgvFvi"
    op = ExportWeightsOp(trained, str(tmp_path / "enc"), [str(identity.to_public()), ssh_recipient])
    enc = _run(engine, op)
    assert not isinstance(enc, Exception), enc
    assert sorted(os.listdir(tmp_path / "enc")) == ["adapter_config.json.age", "adapter_model.safetensors.age"]
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        clear = pyrage.decrypt((tmp_path / "enc" / f"{name}.age").read_bytes(), [identity])
        assert clear == (tmp_path / "plain" / name).read_bytes()
    assert enc["size_bytes"] > plain["size_bytes"]
    assert load(clear).keys() == load_file(tmp_path / "plain" / "adapter_model.safetensors").keys()


@pytest.mark.parametrize("recipients", [["age1notakey"], ["hunter2"], ["ssh-ed25519 AAAA"], ["age1x"] * 11])
def test_a_bad_recipient_fails_before_anything_is_written(engine, trained, tmp_path, recipients):
    result = _run(engine, ExportWeightsOp(trained, str(tmp_path / "e"), recipients))
    assert isinstance(result, UserError), result
    assert "recipient" in result.message
    assert os.listdir(tmp_path) == []


def test_a_full_disk_fails_the_export_and_keeps_the_previous_one(engine, trained, tmp_path, monkeypatch):
    target = tmp_path / "e"
    assert not isinstance(_run(engine, ExportWeightsOp(trained, str(target))), Exception)
    before = {p.name: p.read_bytes() for p in target.iterdir()}

    def enospc(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(checkpoints.os, "fsync", enospc)
    failed = _run(engine, ExportWeightsOp(trained, str(target)))
    assert isinstance(failed, ServerError) and "No space left on device" in failed.message
    monkeypatch.undo()
    assert {p.name: p.read_bytes() for p in target.iterdir()} == before
    assert os.listdir(tmp_path) == ["e"]  # no temporary directory left behind

    # A first export that fails leaves nothing under its name at all.
    monkeypatch.setattr(checkpoints.os, "fsync", enospc)
    assert isinstance(_run(engine, ExportWeightsOp(trained, str(tmp_path / "new"))), ServerError)
    monkeypatch.undo()
    assert os.listdir(tmp_path) == ["e"]


def test_a_failed_first_training_save_leaves_no_directory_under_its_name(engine, trained, tmp_path, monkeypatch):
    def enospc(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(checkpoints.os, "fsync", enospc)  # the files are written with plain writes now
    result = _run(engine, SaveWeightsOp(trained, str(tmp_path / "weights" / "first"), with_optimizer=True))
    monkeypatch.undo()
    assert isinstance(result, ServerError), result
    assert "disk is full" in result.message
    assert os.listdir(tmp_path / "weights") == []


def test_recipient_parsing_accepts_age_and_ssh_keys():
    identity = pyrage.x25519.Identity.generate()
    assert len(export.parse_recipients([f"  {identity.to_public()} "])) == 1
    with pytest.raises(UserError, match="at most 10"):
        export.parse_recipients([str(identity.to_public())] * 11)
