"""A bf16 layer's copies of an adapter's fp32 masters are made once per change (engine/lora/casts.py)."""

from __future__ import annotations

import numpy as np
import torch

from tests.unit.engine.test_cotrain import alone
from tests.unit.engine.test_packed_head import SPEC, train
from tests.unit.engine.test_training import BASE
from tinkerd.engine.lora import casts
from tinkerd.engine.lora.layers import LoraWeights
from tinkerd.types import CreateModelOp, SampleOp, SamplingParams, SaveWeightsOp


def test_the_copies_are_kept_until_a_master_changes_in_place():
    gen = torch.Generator().manual_seed(0)
    lw = LoraWeights(torch.randn(4, 16, generator=gen), torch.randn(8, 4, generator=gen), 2.0)
    a, b = casts.cast_pair(lw, torch.bfloat16)
    assert torch.equal(a, lw.a.to(torch.bfloat16)) and torch.equal(b, lw.b.to(torch.bfloat16))
    assert casts.cast_pair(lw, torch.bfloat16)[0] is a  # unchanged: the same copy
    with torch.no_grad():
        lw.b.mul_(3.0)
    a2, b2 = casts.cast_pair(lw, torch.bfloat16)
    assert torch.equal(b2, lw.b.to(torch.bfloat16)) and not torch.equal(b2, b)
    lw.a = lw.a.clone()  # a new tensor, same version number: a new copy all the same
    assert casts.cast_pair(lw, torch.bfloat16)[0] is not a2
    assert casts.cast_pair(lw, torch.float32) == (lw.a, lw.b)  # the masters' own dtype: no copy


def test_a_trained_adapter_is_cast_per_call_and_keeps_nothing():
    """Its masters change at every optim_step (whose fused AdamW bumps no version counter): fresh
    casts, autograd's, and no copy kept."""
    gen = torch.Generator().manual_seed(1)
    a, b = torch.randn(4, 16, generator=gen).requires_grad_(), torch.randn(8, 4, generator=gen).requires_grad_()
    lw = LoraWeights(a, b, 1.0)
    a16, b16 = casts.cast_pair(lw, torch.bfloat16)
    assert lw.casts is None and a16.grad_fn is not None and torch.equal(a16, a.detach().to(torch.bfloat16))
    with torch.no_grad():
        a.add_(1.0)
    assert torch.equal(casts.cast_pair(lw, torch.bfloat16)[0], a.detach().to(torch.bfloat16))


def test_bf16_sampling_keeps_its_adapters_copies_and_their_numbers(bf16_session_engine, monkeypatch, tmp_path):
    """Sampling from a saved adapter takes the kept copies after its first call, and gives the tokens
    and logprobs that casting on every call gives; the trained adapter it came from keeps none."""
    rt = bf16_session_engine.runtime(BASE)
    assert not isinstance(alone(bf16_session_engine, CreateModelOp("casts-trained", BASE, SPEC)), Exception)
    train(bf16_session_engine, "casts-trained", 1)
    assert not isinstance(alone(bf16_session_engine, SaveWeightsOp("casts-trained", str(tmp_path / "s"), with_optimizer=False)), Exception)
    op = SampleOp(base_model=BASE, adapter_path=str(tmp_path / "s"), prompt=np.arange(100, 120, dtype=np.int64),
                  num_samples=3, params=SamplingParams(max_tokens=6, temperature=1.0, seed=7))
    (kept,) = bf16_session_engine.run_ops([op])
    trained = rt.pool.get("casts-trained").slot
    copies = [(slot, lw.casts) for layer in rt.layers.values() for slot, lw in layer.adapters.items()]
    assert all(c is None for slot, c in copies if slot == trained)
    assert sum(c is not None for slot, c in copies if slot != trained) > 0
    monkeypatch.setattr(casts, "cast_pair", lambda lw, dtype: (lw.a.to(dtype), lw.b.to(dtype)))
    (fresh,) = bf16_session_engine.run_ops([op])
    assert [s.tokens for s in kept.sequences] == [s.tokens for s in fresh.sequences]
    assert [s.logprobs for s in kept.sequences] == [s.logprobs for s in fresh.sequences]
