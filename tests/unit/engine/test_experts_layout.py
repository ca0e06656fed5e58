"""Expert LoRA in files (engine/lora/experts.py: to_file_layout / from_file_layout): hosted
Tinker's w1/w3/w2 keys, and the fused gate_up_proj LoRA tinkerd trains, round-trip exactly."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from tinkerd.engine.checkpoints import read_adapter
from tinkerd.engine.lora.experts import from_file_layout, to_file_layout
from tinkerd.errors import UserError

E, R, H, I = 4, 3, 8, 5
NAME = "model.layers.0.mlp.experts"


def _weights():
    g = torch.Generator().manual_seed(0)
    return {
        f"{NAME}.gate_up_proj": (torch.randn(E, R, H, generator=g), torch.randn(E, 2 * I, R, generator=g)),
        f"{NAME}.down_proj": (torch.randn(E, R, I, generator=g), torch.randn(E, H, R, generator=g)),
        "model.layers.0.self_attn.q_proj": (torch.randn(R, H, generator=g), torch.randn(H, R, generator=g)),
    }


def test_gate_up_is_w1_and_w3_sharing_a_and_the_delta_is_the_same():
    weights = _weights()
    files = {n: (a, b) for name, (a, b) in weights.items() for n, a, b in to_file_layout(name, a, b)}
    assert sorted(files) == [f"{NAME}.w1", f"{NAME}.w2", f"{NAME}.w3", "model.layers.0.self_attn.q_proj"]
    a, b = weights[f"{NAME}.gate_up_proj"]
    delta = b @ a  # [E, 2I, H], gate rows first
    assert torch.equal(files[f"{NAME}.w1"][1] @ files[f"{NAME}.w1"][0], delta[:, :I])
    assert torch.equal(files[f"{NAME}.w3"][1] @ files[f"{NAME}.w3"][0], delta[:, I:])
    back = from_file_layout(files)
    assert set(back) == set(weights) and all(torch.equal(back[n][i], weights[n][i]) for n in weights for i in (0, 1))


def test_a_file_whose_w1_and_w3_have_different_lora_a_is_a_user_error(tmp_path):
    files = {n: (a, b) for name, (a, b) in _weights().items() for n, a, b in to_file_layout(name, a, b)}
    files[f"{NAME}.w3"] = (files[f"{NAME}.w3"][0] + 1, files[f"{NAME}.w3"][1])
    tensors = {f"base_model.model.{n}.lora_{x}.weight": t.contiguous() for n, (a, b) in files.items() for x, t in (("A", a), ("B", b))}
    save_file(tensors, tmp_path / "adapter_model.safetensors")
    (tmp_path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": R, "lora_alpha": R,
                                                             "target_modules": ["q_proj", "w1", "w2", "w3"]}))
    with pytest.raises(UserError, match="different lora_A"):
        read_adapter(tmp_path)
