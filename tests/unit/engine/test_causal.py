"""Causal attention in query blocks (engine/causal.py, engine/causal_gemm.py) against transformers'
SDPA attention: the same attention and gradients up to rounding where it applies, HF's own call to
the bit where it does not."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from tests.unit.engine.cpus import pin
from tinkerd.engine import causal, causal_gemm

HEADS, KV_HEADS, DIM = 6, 2, 16
LAYER = SimpleNamespace(is_causal=True, num_key_value_groups=HEADS // KV_HEADS)


def inputs(t: int, dtype=torch.float32, rows: int = 2, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    # [B, T, heads, d] transposed, as HF's attention layers hand them over.
    q, k, v = (torch.randn(rows, t, h, DIM, generator=gen).to(dtype).transpose(1, 2).requires_grad_()
               for h in (HEADS, KV_HEADS, KV_HEADS))
    g = torch.randn(rows, t, HEADS, DIM, generator=gen).to(dtype)
    return q, k, v, g


def run(fn, q, k, v, g, mask, **kw):
    for x in (q, k, v):
        x.grad = None
    out, _ = fn(LAYER, q, k, v, mask, scaling=DIM ** -0.5, dropout=0.0, **kw)
    out.backward(g)
    return [out.detach()] + [x.grad.clone() for x in (q, k, v)]


def padding_mask(lengths: list[int], t: int, window: int | None = None) -> torch.Tensor:
    """HF's sdpa_mask for right-padded rows: True = attend (causal, real keys, within the window)."""
    i, j = torch.arange(t)[:, None], torch.arange(t)[None, :]
    sees = [(j <= i) & (j < n) & ((i - j < window) if window else True) for n in lengths]
    return torch.stack(sees)[:, None]  # [B, 1, T, T]


def record(monkeypatch, calls: list, fn) -> None:
    apply = fn.apply
    monkeypatch.setattr(fn, "apply", lambda q, *a: calls.append((fn.__name__, q.shape[2])) or apply(q, *a))


@pytest.fixture
def blocked(monkeypatch):
    """(implementation, width) of each blocked call: the flash kernel's blocks or the GEMMs'."""
    calls = []
    record(monkeypatch, calls, causal.CausalBlocks)
    record(monkeypatch, calls, causal_gemm.GemmBlocks)
    record(monkeypatch, calls, causal.WidenedBackward)
    return calls


@pytest.mark.parametrize("column", ["amd", "intel"])  # engine/cpu.py: GEMM blocks from 224 tokens, or flash blocks
@pytest.mark.parametrize("t", [64, 100, 257, 1030])  # 1030: blocks of 64 (256 on Intel), masks past CACHED_KEYS made per call
@pytest.mark.parametrize("mask", ["none", "padding", "window", "prefix", "left padding", "one for all rows"])
def test_blocks_equal_hf_sdpa_and_its_gradients(t, mask, column, blocked, monkeypatch):
    """Any mask under which no query of a block sees a key past the block's last position: causal,
    padded, a sliding window, a prefix seen whole inside the first block, queries that see no key
    at all (left padding: SDPA's zeros, no NaN), one mask broadcast over the rows."""
    pin(monkeypatch, column)
    q, k, v, g = inputs(t)
    m = {"none": None, "padding": padding_mask([t, t - 37], t), "window": padding_mask([t, t], t, window=40),
         "prefix": padding_mask([t, t], t), "left padding": padding_mask([t, t], t),
         "one for all rows": padding_mask([t - 5], t)}[mask]
    if mask == "prefix":
        m[:, :, :20, :20] = True
    if mask == "left padding":
        m[1, :, :, :10] = False
    ours = run(causal.sdpa_attention, q, k, v, g, m, tinkerd_causal_blocks=True)
    theirs = run(sdpa_attention_forward, q, k, v, g, m)
    for a, b, what in zip(ours, theirs, ("output", "d q", "d k", "d v")):
        assert not a.isnan().any(), what
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=what)
    # From there the blocks are oneDNN GEMMs (oneDNN is on here), where the CPU's MKL is not AVX-512.
    gemms = t >= causal_gemm.MIN_WIDTH and column == "amd"
    assert blocked == [("GemmBlocks" if gemms else "CausalBlocks", t)]
    assert len((causal_gemm.spans if gemms else causal.spans)(t)) >= 2


def rel_error(got: list, ref: list) -> list[float]:
    return [float((a.double() - r).norm() / r.norm()) for a, r in zip(got, ref)]


@pytest.mark.parametrize("column", ["amd", "intel"])
@pytest.mark.parametrize("mask", ["none", "padding", "window", "one for all rows"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_long_attention_takes_the_faster_of_the_kernels_one_call_and_its_blocks(column, mask, dtype, blocked, monkeypatch):
    """From causal.PLAIN_FROM tokens, on an Intel CPU with AMX, an attention without a mask (HF's
    is_causal, whose key blocks the kernel skips itself) is HF's one SDPA call to the bit, fp32 or
    bf16. With a mask (under which the kernel computes every key) fp32 takes blocks of LONG_BLOCK
    queries; bf16 right-padded rows run one by one at their own lengths without a mask (a row is
    HF's unmasked call on it alone, to the bit; the padding gets zeros), and any other bf16 mask (a
    sliding window) stays HF's call. The real positions are HF's masked call up to rounding. On the
    AMD column all take the GEMM blocks."""
    pin(monkeypatch, column)
    t = causal.PLAIN_FROM + 64
    short = causal.PLAIN_FROM - 236
    q, k, v, g = inputs(t, dtype)
    m = {"none": None, "padding": padding_mask([t, short], t), "window": padding_mask([t, t], t, window=700),
         "one for all rows": padding_mask([short], t)}[mask]
    real = torch.ones(2, t, dtype=torch.bool)
    if mask == "padding":
        real[1, short:] = False
        g = g * real[:, :, None, None]  # a pass's gradient at padding is zero: nothing reads it
    ours = run(causal.sdpa_attention, q, k, v, g, m, tinkerd_causal_blocks=True)
    theirs = run(sdpa_attention_forward, q, k, v, g, m)
    # "one for all rows": right padding, but one mask broadcast over the rows: HF's call in bf16.
    hf_own = column == "intel" and (mask == "none" or (mask != "padding" and dtype == torch.bfloat16))
    if hf_own:
        assert blocked == []
        for a, b in zip(ours, theirs):
            assert torch.equal(a, b)
        return
    if column == "amd":
        assert blocked == [("GemmBlocks", t)]
    elif mask == "padding" and dtype == torch.bfloat16:
        assert blocked == []
        assert not ours[0][1, short:].any()
        row = [x[:1].detach().requires_grad_() for x in (q, k, v)]
        for a, b in zip(ours, run(sdpa_attention_forward, *row, g[:1], None)):
            assert torch.equal(a[:1], b)  # the long row: HF's one unmasked call on it alone
    else:
        assert blocked == [("CausalBlocks", t)]
        assert {e - s for s, e in causal.spans(t)[:-1]} == {causal.LONG_BLOCK}
    ours[0], theirs[0] = ours[0][real], theirs[0][real]  # outputs at the real positions
    if dtype == torch.float32:
        for a, b, what in zip(ours, theirs, ("output", "d q", "d k", "d v")):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=what)
        return
    if column == "amd":  # GEMM blocks in fp32, rounded once: nearer float64 than the bf16 kernel
        exact = run(sdpa_attention_forward, *(x.detach().double().requires_grad_() for x in (q, k, v)), g.double(), m)
        exact[0] = exact[0][real]
        for mine, hf in zip(rel_error(ours, exact), rel_error(theirs, exact)):
            assert mine < hf, (mine, hf)


@pytest.mark.parametrize("t,padded,column,dtype", [(130, False, "amd", torch.float32), (300, False, "amd", torch.float32),
                                                   (causal.PLAIN_FROM + 10, True, "intel", torch.float32),  # blocks of 256
                                                   (causal.KEY_BLOCK + 10, True, "intel", torch.bfloat16),  # rows alone
                                                   (200, True, "intel", torch.bfloat16)])  # widened backward
def test_a_rows_bits_depend_on_its_width_alone(t, padded, column, dtype, blocked, monkeypatch):
    """Blocks are cut from the width alone, so a row computes the same bits in any batch of its
    width (what lets a shared pass keep each run's bits, engine/grouped.py); bf16 right-padded rows
    on AMX run one by one, so there a row's bits depend on its own length alone."""
    pin(monkeypatch, column)
    q, k, v, g = inputs(t, dtype, rows=3)
    m = padding_mask([t, t - 50, t - 7], t) if padded else None
    together = run(causal.sdpa_attention, q, k, v, g, m, tinkerd_causal_blocks=True)
    one = [x[1:2].detach().requires_grad_() for x in (q, k, v)]
    alone = run(causal.sdpa_attention, *one, g[1:2], None if m is None else m[1:2], tinkerd_causal_blocks=True)
    for a, b in zip(together, alone):
        assert torch.equal(a[1:2], b)
    kind = ("WidenedBackward" if t <= causal.WIDE_BACKWARD else None) if dtype == torch.bfloat16 else (
        "CausalBlocks" if t < 224 or column == "intel" else "GemmBlocks")
    assert blocked == ([] if kind is None else [(kind, t)] * 2)


@pytest.mark.parametrize("case", ["no flag", "short", "sees ahead", "decode", "not causal", "bf16", "bf16 padded"])
def test_any_other_call_is_hfs_own(case, blocked, monkeypatch):
    pin(monkeypatch, "intel")  # bf16: AMX; right-padded rows no wider than causal.KEY_BLOCK stay one call
    # bf16 wider than WIDE_BACKWARD: narrower, its backward is the fp32 kernel's (the test below).
    t = 40 if case == "short" else causal.WIDE_BACKWARD + 44 if case.startswith("bf16") else 96
    q, k, v, g = inputs(t, torch.bfloat16 if case.startswith("bf16") else torch.float32)
    mask, kw = None, {"tinkerd_causal_blocks": case != "no flag"}
    if case == "bf16 padded":
        mask = padding_mask([t, t - 20], t)
    if case == "sees ahead":  # the first 60 positions see each other (an image's tokens, say), past a block
        mask = padding_mask([t, t], t)
        mask[:, :, :60, :60] = True
    if case == "decode":  # one query against cached keys
        q = q[:, :, -1:].detach().requires_grad_()
        g = g[:, -1:]
    hf_kw = {"is_causal": False} if case == "not causal" else {}  # a vision tower's attention
    ours = run(causal.sdpa_attention, q, k, v, g, mask, **kw, **hf_kw)
    theirs = run(sdpa_attention_forward, q, k, v, g, mask, **hf_kw)
    for a, b in zip(ours, theirs):
        assert torch.equal(a, b)
    assert blocked == []


@pytest.mark.parametrize("t", [64, 100, causal.WIDE_BACKWARD])
@pytest.mark.parametrize("mask", ["none", "padding", "window", "one for all rows"])
def test_a_short_bf16_attention_keeps_hfs_output_and_takes_its_gradients_from_fp32_blocks(t, mask, blocked, monkeypatch):
    """With AMX, a bf16 attention up to WIDE_BACKWARD tokens is HF's one call forward, to the bit,
    and its backward the fp32 kernel's in query blocks from widened tensors: gradients nearer
    float64 than the bf16 kernel's own backward, each rounded to bf16 once."""
    pin(monkeypatch, "intel")
    q, k, v, g = inputs(t, torch.bfloat16)
    m = {"none": None, "padding": padding_mask([t, t - 21], t), "window": padding_mask([t, t], t, window=40),
         "one for all rows": padding_mask([t - 5], t)}[mask]
    ours = run(causal.sdpa_attention, q, k, v, g, m, tinkerd_causal_blocks=True)
    theirs = run(sdpa_attention_forward, q, k, v, g, m)
    assert blocked == [("WidenedBackward", t)]
    assert len(causal.spans(t)) >= 2
    assert torch.equal(ours[0], theirs[0])
    assert all(x.dtype == torch.bfloat16 and not x.isnan().any() for x in ours[1:])
    exact = run(sdpa_attention_forward, *(x.detach().double().requires_grad_() for x in (q, k, v)), g.double(), m)
    for what, mine, hf in zip(("d q", "d k", "d v"), rel_error(ours[1:], exact[1:]), rel_error(theirs[1:], exact[1:])):
        assert mine < hf, (what, mine, hf)
