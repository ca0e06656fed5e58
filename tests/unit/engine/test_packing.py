"""The sampler's packed weights (lora/layers.py): q/k/v and gate/up share one stacked packed weight,
each sibling's output through it equals its own linear plus its adapters, siblings called with the
same input share one GEMM, and a sibling called twice does not get its adapters added twice. Both
oneDNN packings (1x1 convolution, inner product) compute the linear row by row; on an Intel CPU
with AVX-512 fp32 packs for the inner product unmeasured, and elsewhere the convolution is given up
where it is slow."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tinkerd.engine import cpu
from tinkerd.engine.lora import layers as lora_layers
from tinkerd.engine.lora.layers import LoraContext, LoraWeights, pack_for_decode, wrap_model

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="needs oneDNN")


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = nn.Module()
        self.attn.q_proj, self.attn.k_proj, self.attn.v_proj = nn.Linear(16, 16), nn.Linear(16, 8), nn.Linear(16, 8)
        self.attn.o_proj = nn.Linear(16, 16)
        self.mlp = nn.Module()
        self.mlp.gate_proj, self.mlp.up_proj = nn.Linear(16, 32, bias=False), nn.Linear(16, 32, bias=False)


@pytest.fixture
def block():
    torch.manual_seed(0)
    ctx = LoraContext()
    model = Block()
    layers = wrap_model(model, ctx, ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj"))
    gen = torch.Generator().manual_seed(1)
    for layer in layers.values():  # an adapter in slot 0 on every layer; rows in slot -1 read the base
        a = torch.randn(4, layer.in_features, generator=gen)
        b = torch.randn(layer.out_features, 4, generator=gen)
        layer.adapters[0] = LoraWeights(a, b, 0.5)
    ctx.set_rows([0, -1, 0])
    return ctx, layers


def test_siblings_share_one_stacked_weight_and_one_gemm(block, monkeypatch):
    ctx, layers = block
    x = torch.randn(3, 5, 16)
    names = ["attn.q_proj", "attn.k_proj", "attn.v_proj", "attn.o_proj", "mlp.gate_proj", "mlp.up_proj"]
    with torch.no_grad():
        want = {n: layers[n](x) for n in names}  # the training path: unpacked, adapters by row
    assert pack_for_decode(layers)
    q, k, v, o, gate, up = (layers[n] for n in names)
    assert q.stack[0] is k.stack[0] is v.stack[0] and gate.stack[0] is up.stack[0]
    assert q.packed_weight is None and o.stack is None and o.packed_weight is not None

    gemms = []
    real = lora_layers._packed_linear
    monkeypatch.setattr(lora_layers, "_packed_linear", lambda *a: gemms.append(1) or real(*a))
    ctx.sampling = True
    with torch.inference_mode():
        first_q = q(x)
        again = q(x)  # q asks twice for one input: a fresh GEMM, its adapters added once
        got = {n: layers[n](x) for n in names[1:]}
    assert len(gemms) == 2 + 1 + 1  # q|k|v twice (k and v took theirs from the second), o, gate|up once
    for n, out in [("attn.q_proj", first_q), ("attn.q_proj", again), *got.items()]:
        torch.testing.assert_close(out, want[n], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("conv", [True, False], ids=["conv_1x1", "inner_product"])
def test_packed_linear_equals_linear_and_each_row_is_its_own(conv):
    """Both packings compute x @ W.T + b at any row count, including past ROWS_PER_CALL where the
    1x1 convolution splits the rows, and a row's output does not depend on the rows beside it."""
    torch.manual_seed(0)
    weight, bias = torch.randn(96, 40), torch.randn(96)
    packed = lora_layers._pack(weight, conv)
    assert packed.dim() == (4 if conv else 2)
    n = lora_layers.ROWS_PER_CALL
    x = torch.randn(3 * n + 2, 40)
    alone = torch.cat([lora_layers.packed_linear_2d(x[i : i + 1], packed, bias) for i in range(x.shape[0])])
    for m in (1, 5, n, n + 1, 3 * n + 2):
        got = lora_layers.packed_linear_2d(x[:m], packed, bias)
        torch.testing.assert_close(got, torch.nn.functional.linear(x[:m], weight, bias), atol=1e-5, rtol=1e-5)
        assert torch.equal(got, alone[:m]), m
    # A non-contiguous input (a column slice, as prefill can pass) gives the same rows.
    wide = torch.randn(7, 80)
    torch.testing.assert_close(
        lora_layers.packed_linear_2d(wide[:, :40], packed, None), torch.nn.functional.linear(wide[:, :40], weight)
    )


@pytest.fixture
def timed_calls(monkeypatch):
    """packed_linear_2d on a fake clock that pack_for_decode reads: each call costs 1 unit, or 40 (a
    re-pack) where slow(packed, x) says so. The real calls still run, but how long they take on a
    loaded machine cannot decide the outcome (a 5x spike at 16 x 16 once failed CI). The CPU is
    taken for one that is not an Intel CPU with AVX-512, where pack_for_decode measures."""
    import types

    monkeypatch.setattr(cpu, "mkl_avx512", lambda: False)

    now = [0.0]
    seen = []
    real = lora_layers.packed_linear_2d
    monkeypatch.setattr(lora_layers, "time", types.SimpleNamespace(perf_counter=lambda: now[0]))

    def install(slow):
        def call(x, packed, bias):
            if packed.dim() == 4:
                seen.append((packed.shape[0], x.shape[0]))
            now[0] += 40.0 if packed.dim() == 4 and slow(packed, x) else 1.0
            return real(x, packed, bias)

        monkeypatch.setattr(lora_layers, "packed_linear_2d", call)
        return seen

    return install


def test_an_intel_cpu_with_avx512_packs_fp32_for_the_inner_product_unmeasured(block, timed_calls, monkeypatch):
    """There the inner product is the faster packing at every row count (lora/layers.py), so it is
    taken without the convolution's timing check, and the sampling path still computes the linear."""
    ctx, layers = block
    seen = timed_calls(lambda packed, x: False)
    monkeypatch.setattr(cpu, "mkl_avx512", lambda: True)
    x = torch.randn(2, 5, 16)
    ctx.set_rows([-1, -1])
    with torch.no_grad():
        want = {n: layers[n](x) for n in layers}
    assert pack_for_decode(layers)
    assert seen == []  # no convolution call: nothing timed
    packed = [m.stack[0].packed if m.stack else m.packed_weight for m in layers.values()]
    assert {p.dim() for p in packed} == {2}
    ctx.sampling = True
    with torch.inference_mode():
        for n in layers:
            torch.testing.assert_close(layers[n](x), want[n], atol=1e-5, rtol=1e-5)


def test_a_fast_1x1_convolution_is_kept(block, timed_calls):
    ctx, layers = block
    seen = timed_calls(lambda packed, x: False)
    assert pack_for_decode(layers)
    assert {m for _, m in seen} == set(range(1, lora_layers.ROWS_PER_CALL + 1))  # every row count checked
    packed = [m.stack[0].packed if m.stack else m.packed_weight for m in layers.values()]
    assert {p.dim() for p in packed} == {4}


def test_a_slow_1x1_convolution_packs_for_the_inner_product(block, timed_calls):
    """Where a 1x1 convolution call re-packs its weight (the layout for its row count differs from
    the packed one), pack_for_decode measures it and packs every linear for the inner product."""
    ctx, layers = block
    timed_calls(lambda packed, x: x.shape[0] == lora_layers.ROWS_PER_CALL)
    assert pack_for_decode(layers)
    packed = [m.stack[0].packed if m.stack else m.packed_weight for m in layers.values()]
    assert {p.dim() for p in packed} == {2}
    x = torch.randn(3, 16)
    ctx.set_rows([-1, -1, -1])
    with torch.inference_mode():
        want = layers["attn.o_proj"](x)
        ctx.sampling = True
        torch.testing.assert_close(layers["attn.o_proj"](x), want, atol=1e-5, rtol=1e-5)


def test_a_1x1_convolution_slow_for_one_shape_at_one_row_count_packs_for_the_inner_product(block, timed_calls):
    """Which shapes and row counts re-pack is irregular (an AVX2 EPYC: 64 x 128 at 8 rows but not 1 or
    48; a 152k x 64 head at 1 row, 0.7 s a call, while the body's biggest linear was fine): one slow
    pair anywhere, here the smallest linear (o_proj, 16 x 16) at 5 rows, gives up the convolution."""
    ctx, layers = block
    seen = timed_calls(lambda packed, x: packed.shape[0] == 16 and x.shape[0] == 5)
    assert pack_for_decode(layers)
    assert (16, 5) in seen
    packed = [m.stack[0].packed if m.stack else m.packed_weight for m in layers.values()]
    assert {p.dim() for p in packed} == {2}


def test_one_slow_call_is_measured_again_and_a_load_spike_keeps_the_convolution(block, timed_calls):
    """A slow first measurement on a busy machine is confirmed before every linear loses the
    convolution: here the 16 x 16 weight at 5 rows is slow twice (the first two timed calls), then
    fast, as a load spike is."""
    ctx, layers = block
    calls = []

    def spike(packed, x):
        if packed.shape[0] == 16 and x.shape[0] == 5:
            calls.append(1)
            return len(calls) in (2, 3)  # call 1 builds the primitive (untimed); 2 and 3 are the first measurement
        return False

    timed_calls(spike)
    assert pack_for_decode(layers)
    assert len(calls) > 3  # the slow pair was measured again
    packed = [m.stack[0].packed if m.stack else m.packed_weight for m in layers.values()]
    assert {p.dim() for p in packed} == {4}


@pytest.mark.skipif(not torch.ops.mkldnn._is_mkldnn_bf16_supported(), reason="needs oneDNN's bf16 kernels")
def test_bf16_weights_pack_for_the_inner_product_and_keep_f_linears_results(block):
    """A bf16 model's linears pack too (the inner product: no timing check), and every layer's
    sampling output matches its training-path output: exactly on base rows here, to bf16 rounding
    on rows with adapters (fp32 master A/B cast to bf16 either way)."""
    ctx, layers = block
    for layer in layers.values():
        layer.base.to(torch.bfloat16)
    x = torch.randn(3, 5, 16).bfloat16()
    for rows in ([-1, -1, -1], [0, -1, 0]):
        ctx.set_rows(rows)
        with torch.no_grad():
            want = {n: layers[n](x) for n in layers}
        if rows[0] == -1:
            assert pack_for_decode(layers)
            packed = [m.stack[0].packed if m.stack else m.packed_weight for m in layers.values()]
            assert {p.dim() for p in packed} == {2} and {p.dtype for p in packed} == {torch.bfloat16}
        ctx.sampling = True
        with torch.inference_mode():
            got = {n: layers[n](x) for n in layers}
        ctx.sampling = False
        for n in layers:
            if rows[0] == -1:
                assert torch.equal(got[n], want[n]), n
            else:
                torch.testing.assert_close(got[n], want[n], atol=0.1, rtol=2e-2)
