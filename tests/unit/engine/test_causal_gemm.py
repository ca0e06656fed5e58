"""Causal attention as oneDNN GEMMs in query blocks (engine/causal_gemm.py): the attention and its
gradients of a float64 reference, the same bits whether the probabilities are kept or made again,
and the calls it takes (fp32, from MIN_WIDTH to MAX_WIDTH tokens, with oneDNN on)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tests.unit.engine.cpus import pin
from tinkerd.engine import causal, causal_gemm, gemm

LAYER = SimpleNamespace(is_causal=True, num_key_value_groups=3)


def inputs(t: int, rows: int = 2, heads: int = 6, kv_heads: int = 2, dim: int = 16, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(rows, t, h, dim, generator=gen).transpose(1, 2).requires_grad_()
               for h in (heads, kv_heads, kv_heads))
    return q, k, v, torch.randn(rows, t, heads, dim, generator=gen).transpose(1, 2)


def grads(fn, q, k, v, g, *args):
    for x in (q, k, v):
        x.grad = None
    out = fn(q, k, v, *args)
    out.backward(g)
    return [out.detach()] + [x.grad.clone() for x in (q, k, v)]


def reference(q, k, v, sees, scale):
    """Plain float64 attention: scores, mask, softmax, weighted values (keys repeated per group)."""
    group = q.shape[1] // k.shape[1]
    q, k, v = (x.double() for x in (q, k, v))
    k, v = (x.repeat_interleave(group, dim=1) for x in (k, v))
    scores = q @ k.transpose(-1, -2) * scale
    t = q.shape[2]
    if sees is None:
        sees = torch.ones(t, t, dtype=torch.bool).tril()
    scores = scores.masked_fill(~sees, float("-inf"))
    return (scores.softmax(-1).nan_to_num(0.0) @ v).float()


@pytest.mark.parametrize("keep", [True, False])
@pytest.mark.parametrize("t,heads,kv_heads", [(256, 6, 2), (300, 4, 4), (600, 8, 2)])
def test_blocks_equal_float64_attention_and_keeping_the_probabilities_changes_no_bit(t, heads, kv_heads, keep,
                                                                                     monkeypatch):
    q, k, v, g = inputs(t, heads=heads, kv_heads=kv_heads)
    ref = grads(reference, q, k, v, g, None, 0.25)
    if not keep:
        kept = grads(causal_gemm.GemmBlocks.apply, q, k, v, g, None, 0.25)
        monkeypatch.setattr(causal_gemm, "KEEP_CELLS", 0)  # the backward makes them again
    ours = grads(causal_gemm.GemmBlocks.apply, q, k, v, g, None, 0.25)
    for a, b, what in zip(ours, ref, ("output", "d q", "d k", "d v")):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=2e-5, msg=what)
    if not keep:
        for a, b in zip(ours, kept):
            assert torch.equal(a, b)
    assert len(causal_gemm.spans(t)) >= 2


def test_a_query_that_sees_no_key_gets_zeros_and_a_padding_mask_is_kept_to():
    t = 256
    q, k, v, g = inputs(t)
    i, j = torch.arange(t)[:, None], torch.arange(t)[None, :]
    sees = torch.stack([(j <= i) & (j < 200), (j <= i) & (j >= 10)])[:, None]  # right padding; left padding
    ours = grads(causal_gemm.GemmBlocks.apply, q, k, v, g, sees, 0.25)
    ref = grads(reference, q, k, v, g, sees, 0.25)
    for a, b in zip(ours, ref):
        assert not a.isnan().any()
        torch.testing.assert_close(a, b, rtol=1e-5, atol=2e-5)
    assert torch.equal(ours[0][1, :, :10], torch.zeros_like(ours[0][1, :, :10]))


@pytest.fixture
def calls(monkeypatch):
    seen = []
    for fn in (causal.CausalBlocks, causal_gemm.GemmBlocks):
        apply = fn.apply
        monkeypatch.setattr(fn, "apply", lambda q, *a, fn=fn, apply=apply: seen.append(fn.__name__) or apply(q, *a))
    return seen


@pytest.mark.parametrize("case,expected", [("wide", "GemmBlocks"), ("narrow", "CausalBlocks"),
                                           ("too wide", "CausalBlocks"), ("oneDNN off", "CausalBlocks"),
                                           ("a mask per head", "CausalBlocks"), ("an Intel CPU", "CausalBlocks")])
def test_which_blocks_a_training_pass_gets(case, expected, calls, monkeypatch):
    """engine/cpu.py: on an Intel CPU MKL's AVX-512 runs the flash kernel's products, and its blocks beat these."""
    pin(monkeypatch, "intel" if case == "an Intel CPU" else "amd")
    mask = None
    if case == "a mask per head":  # not HF's [B, 1, T, T]: the flash kernel broadcasts it, these blocks would not
        mask = torch.ones(256, 256, dtype=torch.bool).tril().expand(2, 6, 256, 256)
    if case == "too wide":
        monkeypatch.setattr(causal_gemm, "MAX_WIDTH", 255)
    if case == "oneDNN off":
        monkeypatch.setenv(gemm.ENV, "torch")
        gemm.onednn.cache_clear()
    try:
        q, k, v, g = inputs(200 if case == "narrow" else 256)
        out, _ = causal.sdpa_attention(LAYER, q, k, v, mask, scaling=None, tinkerd_causal_blocks=True)
        out.backward(g.transpose(1, 2))
    finally:
        gemm.onednn.cache_clear()
    assert calls == [expected]
    ref = reference(q.detach(), k.detach(), v.detach(), None, q.shape[-1] ** -0.5)  # scaling None: SDPA's default
    torch.testing.assert_close(out.transpose(1, 2), ref, rtol=1e-5, atol=2e-5)


def test_a_bf16_pass_gets_the_blocks_in_fp32_nearer_the_exact_answer_than_the_bf16_kernel(calls, monkeypatch):
    """bf16 q, k, v: widened, attended in fp32, output and gradients rounded to bf16 once; each
    nearer the float64 answer than transformers' bf16 SDPA call (the kernel it replaces)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    pin(monkeypatch, "amd")

    t = 256
    q, k, v, g = inputs(t)
    low = [x.detach().bfloat16().requires_grad_() for x in (q, k, v)]
    g = g.bfloat16().float()
    exact = grads(reference, *(x.detach().float().requires_grad_() for x in low), g, None, 0.25)  # of the bf16 inputs
    ours = grads(lambda *a: causal.sdpa_attention(LAYER, *a, None, scaling=0.25, tinkerd_causal_blocks=True)[0]
                 .transpose(1, 2), *low, g.bfloat16())
    theirs = grads(lambda *a: sdpa_attention_forward(LAYER, *a, None, scaling=0.25)[0].transpose(1, 2), *low,
                   g.bfloat16())
    assert calls == ["GemmBlocks"]
    for a, b, x, what in zip(ours, theirs, exact, ("output", "d q", "d k", "d v")):
        assert a.dtype == torch.bfloat16, what
        ours_err, theirs_err = ((y.float() - x).abs().max().item() for y in (a, b))
        assert ours_err < theirs_err, (what, ours_err, theirs_err)
        torch.testing.assert_close(a.float(), x, rtol=2 ** -7, atol=1e-3, msg=what)  # one rounding to bf16


def test_a_bf16_pass_on_amx_gets_transformers_sdpa_call(calls, monkeypatch):
    """engine/cpu.py: with AMX torch's bf16 flash kernel beats the fp32 blocks (1.15x a SmolLM2 step at
    2 threads), so a bf16 pass's attention is transformers' own SDPA call there, to the bit, from
    causal.WIDE_BACKWARD tokens (narrower, only its forward is: test_causal.py)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    pin(monkeypatch, "intel")
    q, k, v, g = inputs(causal.WIDE_BACKWARD + 64)
    low = [x.detach().bfloat16().requires_grad_() for x in (q, k, v)]
    ours = grads(lambda *a: causal.sdpa_attention(LAYER, *a, None, scaling=0.25, tinkerd_causal_blocks=True)[0]
                 .transpose(1, 2), *low, g.bfloat16())
    theirs = grads(lambda *a: sdpa_attention_forward(LAYER, *a, None, scaling=0.25)[0].transpose(1, 2), *low,
                   g.bfloat16())
    assert calls == []
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs))
