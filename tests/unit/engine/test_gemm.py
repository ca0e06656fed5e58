"""engine/gemm.py: a training pass's fp32 base GEMMs through oneDNN on a CPU.

Each function equals its float64 product to fp32 rounding, for the operand layouts the engine hands
it (transposed views included); the fused LoRA node runs its base GEMMs and, from LORA_MIN_ROWS rows
of a part, its LoRA products there, and still equals the layer written as float64 autograd ops;
`TINKERD_CPU_GEMM=torch` gives torch's own bits, and a bad value is refused by name.
"""

from __future__ import annotations

import pytest
import torch

from tinkerd.engine import gemm
from tinkerd.engine.lora.fused import LoraLinear, Part

needs_onednn = pytest.mark.skipif(not gemm.onednn(), reason="oneDNN's linear is not in this torch build")


def close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == torch.float32 and got.shape == want.shape
    err = (got.double() - want).abs().max() / want.abs().max()
    assert err < 1e-5, err


@pytest.fixture
def counted(monkeypatch):
    """How many GEMMs went through oneDNN's op."""
    calls = []
    linear = gemm._linear
    monkeypatch.setattr(gemm, "_linear", lambda *a: calls.append(1) or linear(*a))
    return calls


@pytest.fixture(params=[256, gemm.NEVER], ids=["lora-onednn-from-256", "lora-mkl"])
def lora_min_rows(request, monkeypatch):
    """engine/cpu.py's two columns for the LoRA products: oneDNN's from 256 rows (AMD), MKL's always (Intel)."""
    monkeypatch.setattr(gemm, "LORA_MIN_ROWS", request.param)
    return request.param


@needs_onednn
@pytest.mark.parametrize("rows", [8, 300])
def test_each_function_equals_the_float64_product(rows, counted, lora_min_rows):
    g = torch.Generator().manual_seed(0)
    x, w, bias = torch.randn(rows, 96, generator=g), torch.randn(160, 96, generator=g), torch.randn(160, generator=g)
    d = torch.randn(rows, 160, generator=g)
    x64, w64, d64 = x.double(), w.double(), d.double()
    close(gemm.linear(x, w, bias), x64 @ w64.t() + bias.double())
    close(gemm.linear(x.view(2, rows // 2, 96), w), (x64 @ w64.t()).view(2, rows // 2, 160))
    close(gemm.input_grad(d, w), d64 @ w64)
    close(gemm.lora_mm(d.t(), x, rows), d64.t() @ x64)  # a weight gradient: a transposed view
    close(gemm.lora_mm(x, w.t(), rows), x64 @ w64.t())
    close(gemm.lora_b_grad(d, x, rows), d64.t() @ x64)  # made as (x^T d)^T from LORA_MIN_ROWS rows
    out = torch.empty(rows, 96)
    gemm.add_input_grad(out, d, w, first=True)
    gemm.add_input_grad(out, d, w, first=False)
    close(out, 2 * d64 @ w64)
    assert len(counted) == 5 + 3 * (rows >= gemm.LORA_MIN_ROWS)  # below LORA_MIN_ROWS a LoRA product is torch.mm's


@needs_onednn
def test_under_autograd_it_leaves_the_product_to_torch(counted):
    x = torch.randn(4, 8, requires_grad=True)
    y = gemm.linear(x, torch.randn(5, 8))
    y.sum().backward()
    assert y.grad_fn is not None and x.grad is not None and not counted


@needs_onednn
@pytest.mark.parametrize("rows_per_part", [12, 300])
def test_the_fused_node_runs_its_gemms_on_onednn_and_equals_the_layer(rows_per_part, counted, lora_min_rows):
    """Two runs of a shared pass, fp32: output and every gradient within fp32 rounding of the layer
    as float64 autograd ops; the base forward and input gradient on oneDNN, and the four LoRA
    products and the two sums of each run's deltas there too once a run has LORA_MIN_ROWS rows."""
    g = torch.Generator().manual_seed(1)
    t, d_in, d_out, rank = rows_per_part // 3, 64, 48, 4
    parts = (Part(0, 3, t, 1.0), Part(3, 6, t, 0.5))
    x = torch.randn(6, t, d_in, generator=g)
    w = torch.randn(d_out, d_in, generator=g) / 8
    a_s = [torch.randn(rank, d_in, generator=g) for _ in parts]
    b_s = [torch.randn(d_out, rank, generator=g) for _ in parts]
    dy = torch.randn(6, t, d_out, generator=g)

    def run(dtype):
        leaves = [v.detach().to(dtype, copy=True).requires_grad_() for v in (x, *a_s, *b_s)]
        xl, al, bl = leaves[0], leaves[1:3], leaves[3:]
        if dtype == torch.float32:
            y = LoraLinear.apply(xl, w, None, parts, False, *al, *bl)
        else:
            y = xl @ w.double().t()
            y = torch.cat([y[p.start:p.stop] + (xl[p.start:p.stop] @ a.t()) @ b.t() * p.scaling
                           for p, a, b in zip(parts, al, bl)])
        y.backward(dy.to(dtype))
        return [y.detach(), *(v.grad for v in leaves)]

    got = run(torch.float32)
    assert len(counted) == 2 + (6 * len(parts) if rows_per_part >= gemm.LORA_MIN_ROWS else 0)
    for ours, want in zip(got, run(torch.float64)):
        close(ours, want)


def test_torch_gemm_when_turned_off_and_a_bad_value_refused(monkeypatch):
    x, w = torch.randn(300, 64), torch.randn(80, 64)
    try:
        monkeypatch.setenv(gemm.ENV, "torch")
        gemm.onednn.cache_clear()
        assert not gemm.onednn()
        assert torch.equal(gemm.linear(x, w), torch.nn.functional.linear(x, w))
        assert torch.equal(gemm.lora_mm(x.t(), x, 300), torch.mm(x.t(), x))
        monkeypatch.setenv(gemm.ENV, "mkl")
        gemm.onednn.cache_clear()
        with pytest.raises(ValueError, match="TINKERD_CPU_GEMM='mkl'"):
            gemm.onednn()
    finally:
        monkeypatch.delenv(gemm.ENV)
        gemm.onednn.cache_clear()
