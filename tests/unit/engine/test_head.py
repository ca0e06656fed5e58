"""The LM head's pass (engine/head.py): the tiled path against a float64 reference and against
the autograd path, and kept logits against recomputed ones, to the bit."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from tests.unit.engine.test_training import BASE, adapter_of, assert_identical, create, run
from tinkerd.engine import gemm, head
from tinkerd.engine.head import HeadPass
from tinkerd.engine.lora.layers import LoraContext, LoraWeights, MultiLoraLinear
from tinkerd.engine.precision import Precision
from tinkerd.engine.recompute import Recompute
from tinkerd.types import Datum, ForwardBackwardOp


def _runtime(vocab: int, hidden: int, lora: LoraWeights | None):
    """A runtime holding only a head: a MultiLoraLinear with (or without) one adapter in slot 0."""
    torch.manual_seed(0)
    base = torch.nn.Linear(hidden, vocab, bias=False)
    with torch.no_grad():
        base.weight.normal_(0, 0.05)
    ctx = LoraContext()
    layer = MultiLoraLinear(base, ctx)
    if lora is not None:
        layer.adapters[0] = lora
    ctx.set_single(0)
    model = SimpleNamespace(get_output_embeddings=lambda: layer, config=SimpleNamespace())
    return SimpleNamespace(model=model, vocab_size=vocab, ctx=ctx)


@pytest.mark.parametrize("soft", [False, True])
@pytest.mark.parametrize("scaling", [None, 1.0, 0.75])
@pytest.mark.parametrize("direct", [False, True])
@pytest.mark.parametrize("lora_onednn_from", [64, 14])
def test_tiled_head_equals_a_float64_reference(monkeypatch, soft, scaling, direct, lora_onednn_from):
    """Logprobs, d hidden and the head LoRA's grads of the written-out backward, over several row
    blocks and vocabulary tiles (targets in every tile), against autograd in float64; B's gradient
    made either way (head.direct_b_grad), in B's layout. With the LoRA's products on oneDNN from 14
    rows, the 14-row block takes them there (three per tile) and the 13-row ones stay on MKL."""
    monkeypatch.setattr(head, "direct_b_grad", lambda rows: direct)
    monkeypatch.setattr(head, "LORA_MIN_ROWS", lora_onednn_from)
    calls = []
    linear, onednn = gemm._linear, gemm.onednn()  # onednn() probes _linear once per process: before counting
    monkeypatch.setattr(gemm, "_linear", lambda x, w, b: calls.append(tuple(w.shape)) or linear(x, w, b))
    monkeypatch.setattr(head, "ROW_BLOCK", 16)
    monkeypatch.setattr(head, "TILE_CELLS", 16 * 700)
    monkeypatch.setattr(head, "MIN_TILE", 1)
    vocab, hidden, m, rank = 3000, 24, 40, 4  # 3 blocks (14, 13, 13 rows); tiles of 700 columns (the last 200)
    gen = torch.Generator().manual_seed(1)
    lora = None if scaling is None else LoraWeights(torch.randn(rank, hidden, generator=gen) * 0.1,
                                                    torch.randn(vocab, rank, generator=gen) * 0.1, scaling)
    rt = _runtime(vocab, hidden, lora)
    x = torch.randn(m, hidden, generator=gen)
    targets = torch.randint(0, vocab, (m, 3) if soft else (m,), generator=gen)
    g = torch.randn(targets.shape, generator=gen)

    got = HeadPass(rt, x, targets, keep=True)
    assert got.tiled and len(got.blocks) == 3 and len(got.tiles) >= 3
    params = [] if lora is None else [lora.a, lora.b]
    g_x, g_params = got.backward(g, params)

    w = rt.model.get_output_embeddings().weight.double().requires_grad_(True)
    x64 = x.double().requires_grad_(True)
    p64 = [t.double().requires_grad_(True) for t in params]
    logits = x64 @ w.t()
    if lora is not None:
        logits = logits + (x64 @ p64[0].t()) @ p64[1].t() * scaling
    lse = torch.logsumexp(logits, -1)
    lp = logits.gather(-1, targets if soft else targets[:, None]) - lse[:, None]
    lp = lp if soft else lp[:, 0]
    want = torch.autograd.grad((lp * g.double()).sum(), [x64, *p64])

    torch.testing.assert_close(got.logprobs.double(), lp.detach(), rtol=0, atol=2e-5)
    for ours, ref in zip([g_x, *g_params], want):
        assert ours.dtype == torch.float32
        assert (ours.double() - ref).abs().max() <= 1e-5 * ref.abs().max()
    for ours, p in zip(g_params, params):
        assert ours.stride() == p.stride()  # fused CPU AdamW reads a gradient in its parameter's memory order
    if onednn:  # beside the base GEMMs, a forward and an input gradient per block and tile (kept logits)
        lora_calls = len(calls) - 2 * len(got.blocks) * len(got.tiles)
        assert lora_calls == (0 if lora is None or lora_onednn_from > 14 else 3 * len(got.tiles))


def _data(loss_fn: str, soft: bool = False) -> list[Datum]:
    rng = np.random.default_rng(7)
    data = []
    for n in (9, 13, 6, 11):
        seq = rng.integers(0, 150_000, n + 1)
        targets = np.stack([seq[1:], rng.integers(0, 150_000, n)], 1) if soft else seq[1:]
        extra = {"logprobs": -rng.random(n).astype(np.float32), "advantages": rng.standard_normal(n).astype(np.float32)}
        if soft:
            extra = {"weights": rng.random((n, 2)).astype(np.float32)}
        data.append(Datum(tokens=seq[:-1], loss_fn_inputs={"target_tokens": targets,
                                                           **(extra if loss_fn != "cross_entropy" or soft else {})}))
    return data


def _pass(engine, model_id: str, data, loss_fn: str):
    create(engine, model_id, seed=3)
    result = run(engine, ForwardBackwardOp(model_id, data, loss_fn))
    return (result.metrics["loss:sum"], [o["logprobs"] for o in result.loss_fn_outputs],
            [t.grad for t in adapter_of(engine, model_id).parameters()])


@pytest.mark.parametrize("soft", [False, True])
@pytest.mark.parametrize("keep", [False, True])
def test_no_rows_give_empty_logprobs_and_grads(soft, keep):
    """A rank given no datums (engine/sharding.py) runs the head on zero rows: empty logprobs and d
    hidden, zero LoRA grads, no error (an error there left rank 0 waiting in its gather for good)."""
    lora = LoraWeights(torch.randn(4, 24) * 0.1, torch.randn(3000, 4) * 0.1, 1.0)
    rt = _runtime(3000, 24, lora)
    targets = torch.zeros((0, 3) if soft else (0,), dtype=torch.long)
    got = HeadPass(rt, torch.randn(0, 24), targets, keep=keep)
    assert got.tiled and got.logprobs.shape == targets.shape
    g_x, (g_a, g_b) = got.backward(torch.zeros(targets.shape), [lora.a, lora.b])
    assert g_x.shape == (0, 24)
    assert g_a.shape == lora.a.shape and g_b.shape == lora.b.shape
    assert not g_a.any() and not g_b.any()


@pytest.mark.parametrize("path", ["tiled", "autograd"])
@pytest.mark.parametrize("loss_fn", ["cross_entropy", "importance_sampling"])
def test_kept_logits_give_the_bits_of_a_recomputed_head(engine, monkeypatch, path, loss_fn):
    """Logits under KEEP_CELLS are kept from the forward to the backward instead of computed twice;
    logprobs, loss and every LoRA grad (the head's own included) equal the recomputing path's."""
    rt = engine.runtime(BASE)
    monkeypatch.setattr(head, "ROW_BLOCK", 16)  # 39 positions: 3 blocks
    monkeypatch.setattr(head, "TILE_CELLS", 16 * 40_000)  # tiled: 4 tiles
    monkeypatch.setattr(head, "CHUNK_CELLS", rt.vocab_size * 8)  # autograd: 5 chunks
    monkeypatch.setattr(head, "CHUNK_MIN_ROWS", 8)
    computed = []  # head GEMMs of the whole vocabulary: tiles of a block, or autograd chunks
    if path == "tiled":
        logits = HeadPass._logits
        monkeypatch.setattr(HeadPass, "_logits", lambda self, *a: computed.append(1) or logits(self, *a))
    else:
        monkeypatch.setattr(head, "tiled", lambda *a: False)
        logprobs = head._logprobs
        monkeypatch.setattr(head, "_logprobs", lambda *a: computed.append(1) or logprobs(*a))
    got = {}
    for keep_cells in (head.KEEP_CELLS, 0):
        monkeypatch.setattr(head, "KEEP_CELLS", keep_cells)
        computed.clear()
        numbers = _pass(engine, f"head-keep-{path}-{loss_fn}-{keep_cells}", _data(loss_fn), loss_fn)
        got[keep_cells] = (len(computed), *numbers)
    kept, recomputed = got.values()
    expected = 3 * 4 if path == "tiled" else 5
    assert (kept[0], recomputed[0]) == (expected, 2 * expected)
    assert kept[1] == recomputed[1]
    for a, b in zip(kept[2], recomputed[2]):
        assert np.array_equal(a, b)
    assert any(name.endswith("lm_head") for name in adapter_of(engine, f"head-keep-{path}-{loss_fn}-0").weights)
    assert_identical(kept[3], recomputed[3])


@pytest.mark.parametrize("soft", [False, True])
def test_tiled_and_autograd_heads_agree_through_the_engine(engine, monkeypatch, soft):
    """The two paths on the tiny model with its head's LoRA, several blocks and tiles: the same
    numbers to fp32 rounding."""
    monkeypatch.setattr(head, "ROW_BLOCK", 16)
    monkeypatch.setattr(head, "TILE_CELLS", 16 * 40_000)
    tiled = _pass(engine, f"head-tiled-{soft}", _data("cross_entropy", soft), "cross_entropy")
    monkeypatch.setattr(head, "tiled", lambda *a: False)
    autograd = _pass(engine, f"head-autograd-{soft}", _data("cross_entropy", soft), "cross_entropy")
    assert tiled[0] == pytest.approx(autograd[0], rel=1e-6)
    for a, b in zip(tiled[1], autograd[1]):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-5)
    for a, b in zip(tiled[2], autograd[2]):
        assert (a - b).abs().max() <= 1e-4 * b.abs().max()


@pytest.mark.parametrize("soft", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_target_logprobs_of_the_autograd_head_against_float64(soft, dtype):
    """The non-tiled head's logprobs (head.TargetLogprobs: a bf16 head, a softcap, a bias): fp32
    logprobs whose forward is torch's logsumexp to the bit (its sequence, on the upcast logits), and
    d logits from the kept exponentials within fp32 rounding of float64 autograd, in the logits'
    dtype; soft targets may repeat a token."""
    gen = torch.Generator().manual_seed(2)
    logits = (torch.randn(37, 5000, generator=gen) * 4).to(dtype)
    targets = torch.randint(0, 5000, (37, 3) if soft else (37,), generator=gen)
    if soft:
        targets[:, 2] = targets[:, 0]
    g = torch.randn(targets.shape, generator=gen)
    leaf = logits.clone().requires_grad_(True)
    lp = head.TargetLogprobs.apply(leaf, targets)
    (d,) = torch.autograd.grad(lp, leaf, g)

    up = logits.float()
    t = targets if soft else targets[:, None]
    want = up.gather(-1, t) - torch.logsumexp(up, -1, keepdim=True)
    assert lp.dtype == torch.float32 and torch.equal(lp, want if soft else want[:, 0])

    x64 = logits.double().requires_grad_(True)
    lp64 = x64.gather(-1, t) - torch.logsumexp(x64, -1, keepdim=True)
    (d64,) = torch.autograd.grad(lp64 if soft else lp64[:, 0], x64, g.double())
    assert d.dtype == dtype
    tol = 1e-6 if dtype == torch.float32 else 1e-2  # bf16: the gradient is rounded to bf16 at the end
    assert (d.double() - d64).abs().max() <= tol * d64.abs().max()


def test_logits_past_keep_cells_are_kept_where_the_decoder_keeps_far_more():
    """Past KEEP_CELLS a model keeps its logits for the backward when a position's are at most
    BODY_SHARE of its decoder's estimated activations: SmolLM2 (49k vocabulary, 30 layers of 576 +
    1,536) and Qwen3-0.6B (152k, 28 layers of 1,024 + 3,072) at any batch; Gemma 3 270M's shape
    (262k, 18 layers of 640 + 2,048) only up to KEEP_CELLS; a vision-language model by its text
    decoder's config. And past KEEP_CELLS only while they fit the memory the engine may use for
    activations (engine/recompute.py: here a budget of 1 TB)."""
    from transformers import LlamaConfig, Qwen3Config, Qwen3VLConfig

    def runtime(config, budget=10**12):
        text = config.get_text_config()
        return SimpleNamespace(vocab_size=text.vocab_size, model=SimpleNamespace(config=config),
                               recompute=Recompute(budget), precision=Precision())

    smol = runtime(LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30))
    qwen = runtime(Qwen3Config(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28))
    gemma = runtime(LlamaConfig(vocab_size=262144, hidden_size=640, intermediate_size=2048, num_hidden_layers=18))
    assert head.keeps(smol, 3100) and head.keeps(smol, 1 << 16) and head.keeps(qwen, 1 << 16)
    fits = head.KEEP_CELLS // 262144
    assert head.keeps(gemma, fits) and not head.keeps(gemma, fits + 1)
    vl = Qwen3VLConfig(text_config=dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30))
    assert head.keeps(runtime(vl), 1 << 16)
    rows = 3100  # the GRPO shape's head rows: 610 MB of fp32 logits
    assert head.keeps(runtime(smol.model.config, rows * 49152 * 4), rows)
    assert not head.keeps(runtime(smol.model.config, rows * 49152 * 4 - 1), rows)
    assert head.keeps(runtime(smol.model.config, 0), head.KEEP_CELLS // 49152)  # always up to KEEP_CELLS
