"""A bf16 head trains through its packed weight only where that changes no bit (engine/lora/packed_head.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.unit.engine.test_cotrain import alone, state
from tests.unit.engine.test_training import BASE, sft_data
from tinkerd.engine.lora import packed_head
from tinkerd.engine.lora.layers import pack_for_decode
from tinkerd.types import AdamParams, CreateModelOp, ForwardBackwardOp, LoraSpec, OptimStepOp

pytestmark = pytest.mark.skipif(not (torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()),
                                reason="no oneDNN bf16 kernels on this CPU: the head keeps F.linear")

SPEC = LoraSpec(rank=4, alpha=8.0, seed=3)
# 283 positions: head chunks of 128, 128 and 27 rows (engine/head.py: chunk_rows).
LENGTHS = (100, 90, 93)


def train(engine, model_id: str, steps: int) -> list:
    got = []
    for i in range(steps):
        result = alone(engine, ForwardBackwardOp(model_id, sft_data(40 + i, lengths=LENGTHS), "cross_entropy"))
        assert not isinstance(result, Exception), result
        got.append((result.metrics["loss:sum"], [o["logprobs"] for o in result.loss_fn_outputs], state(engine, model_id)))
        assert not isinstance(alone(engine, OptimStepOp(model_id, AdamParams(learning_rate=1e-2))), Exception)
    return got


def assert_same(packed: list, plain: list) -> None:
    for (loss_a, lps_a, state_a), (loss_b, lps_b, state_b) in zip(packed, plain):
        assert loss_a == loss_b
        assert all(np.array_equal(a, b) for a, b in zip(lps_a, lps_b))
        assert all(torch.equal(a, b) for a, b in zip(state_a["grads"], state_b["grads"]))
        for name, (a, b) in state_a["weights"].items():
            assert torch.equal(a, state_b["weights"][name][0]) and torch.equal(b, state_b["weights"][name][1]), name


def test_a_bf16_head_trains_through_its_packed_weight_with_f_linears_bits(bf16_session_engine, monkeypatch):
    """Every chunk's forward GEMM of the head goes through the packed copy, and twin adapters, one
    trained that way and one through F.linear, stay equal to the bit over steps: logprobs, loss,
    gradients and weights. The packed copy is the one the sampler then uses."""
    rt = bf16_session_engine.runtime(BASE)
    head = rt.model.get_output_embeddings()
    pack = head.head_pack
    assert pack is not None and pack.max_rows == 128
    for m in ("packed-head-on", "packed-head-off"):
        assert not isinstance(alone(bf16_session_engine, CreateModelOp(m, BASE, SPEC)), Exception)
    calls = []
    apply = packed_head.PackedLinear.apply
    monkeypatch.setattr(packed_head.PackedLinear, "apply", lambda x, p, w: calls.append(x.shape[0]) or apply(x, p, w))
    packed = train(bf16_session_engine, "packed-head-on", 2)
    assert sorted(calls) == sorted([128, 128, 27] * 2)
    calls.clear()
    head.head_pack = None
    try:
        plain = train(bf16_session_engine, "packed-head-off", 2)
    finally:
        head.head_pack = pack
    assert calls == []
    assert_same(packed, plain)
    kept = head.packed_weight
    assert kept is not None
    pack_for_decode(rt.layers)
    assert head.packed_weight is kept  # the sampler's copy is the training one, not a second


def test_a_packed_head_that_rounds_otherwise_keeps_f_linear(bf16_session_engine, monkeypatch):
    """Where the check finds the packed product off F.linear's bits at some row count, the head
    trains through F.linear, and its numbers are those of an engine that never packed."""
    rt = bf16_session_engine.runtime(BASE)
    head = rt.model.get_output_embeddings()
    from tinkerd.engine.lora import layers

    real = layers.packed_linear_2d

    def off_at_17_rows(x, packed, bias):
        out = real(x, packed, bias)
        return out.add(1e-2) if x.shape[0] == 17 else out

    monkeypatch.setattr(layers, "packed_linear_2d", off_at_17_rows)
    fresh = packed_head.HeadPack(head, 128)
    assert fresh.weight_for(torch.zeros(5, head.in_features, dtype=torch.bfloat16)) is None
    monkeypatch.setattr(head, "head_pack", fresh)
    calls = []
    apply = packed_head.PackedLinear.apply
    monkeypatch.setattr(packed_head.PackedLinear, "apply", lambda x, p, w: calls.append(x.shape[0]) or apply(x, p, w))
    for m in ("refused-head-a", "refused-head-b"):
        assert not isinstance(alone(bf16_session_engine, CreateModelOp(m, BASE, SPEC)), Exception)
    refused = train(bf16_session_engine, "refused-head-a", 1)
    assert calls == []
    monkeypatch.setattr(head, "head_pack", None)
    assert_same(refused, train(bf16_session_engine, "refused-head-b", 1))


def test_only_a_bf16_cpu_head_gets_a_pack(models_dir):
    """fp32 heads take the tiled path (engine/head.py) and keep their own GEMMs: no pack there."""
    from tinkerd.engine.engine import Engine

    rt = Engine(models_dir).load_base_model(BASE)
    assert rt.model.get_output_embeddings().head_pack is None
    assert packed_head.probe_rows(128)[:3] == [1, 2, 3] and packed_head.probe_rows(128)[-2:] == [127, 128]


def test_a_head_that_cannot_be_packed_keeps_f_linear_and_is_not_packed_again(bf16_session_engine, monkeypatch):
    from tinkerd.engine.lora import layers

    head = bf16_session_engine.runtime(BASE).model.get_output_embeddings()
    tries = []

    def no_op_here(weight, conv):
        tries.append(conv)
        raise RuntimeError("no oneDNN reorder op in this build")

    monkeypatch.setattr(layers, "_pack", no_op_here)
    monkeypatch.setattr(head, "packed_weight", None)
    pack = packed_head.HeadPack(head, 128)
    x = torch.zeros(5, head.in_features, dtype=torch.bfloat16)
    assert pack.weight_for(x) is None and pack.weight_for(x) is None
    assert tries == [False]
