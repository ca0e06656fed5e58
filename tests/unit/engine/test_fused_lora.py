"""engine/lora/fused.py: a LoRA linear of a training pass as one autograd node.

Its forward and every gradient are checked against the same layer written as autograd ops
(`base(x) + scaling * (x A^T) B^T` per run's rows), and its backward against finite differences
(torch.autograd.gradcheck, float64): one run over every row, runs in blocks of a shared pass at
their own widths (a narrower one padded, a single narrow row), runs of one shape through the
batched GEMMs, scalings that are and are not powers of two, a base with a bias, and an input that
needs no gradient (a first layer's).
"""

from __future__ import annotations

import pytest
import torch

from tinkerd.engine.lora.fused import LoraLinear, Part, parts_of

B, T, IN, OUT = 5, 6, 7, 9


def adapters(parts, rank=3, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    a = [torch.randn(rank, IN, generator=g, dtype=dtype, requires_grad=True) for _ in parts]
    b = [torch.randn(OUT, rank, generator=g, dtype=dtype, requires_grad=True) for _ in parts]
    return a, b


def reference(x, w, bias, parts, a_s, b_s):
    """The layer as autograd ops: the base, then each part's delta on its rows and width."""
    y = torch.nn.functional.linear(x, w, bias)
    deltas = torch.zeros_like(y)
    for p, a, b in zip(parts, a_s, b_s):
        xs = x[p.start:p.stop, :p.width]
        delta = (xs @ a.t()) @ b.t() * p.scaling
        deltas = deltas.index_put((torch.arange(p.start, p.stop)[:, None], torch.arange(p.width)[None, :]), delta,
                                  accumulate=True)
    return y + deltas


CASES = {
    "one run, every row": ((Part(0, B, T, 1.0),), False),
    "one run, scaling 4": ((Part(0, B, T, 4.0),), False),
    "one run, scaling 1.5": ((Part(0, B, T, 1.5),), False),
    "blocks at their widths": ((Part(0, 2, T, 2.0), Part(2, 4, 4, 0.75), Part(4, 5, 3, 1.0)), False),
    "a block without an adapter": ((Part(0, 2, T, 1.0), Part(3, 5, 5, 8.0)), False),
    "one shape, batched": ((Part(0, 1, T, 1.0), Part(1, 2, T, 4.0), Part(2, 3, T, 0.5)), True),
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("with_bias", [False, True])
def test_forward_and_gradients_equal_the_layer_written_as_autograd_ops(case, with_bias):
    parts, batched = CASES[case]
    rows = parts[-1].stop if batched else B
    g = torch.Generator().manual_seed(1)
    x = torch.randn(rows, T, IN, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(OUT, IN, generator=g, dtype=torch.float64)
    bias = torch.randn(OUT, generator=g, dtype=torch.float64) if with_bias else None
    a_s, b_s = adapters(parts)
    got = LoraLinear.apply(x, w, bias, parts, batched, *a_s, *b_s)
    want = reference(x, w, bias, parts, a_s, b_s)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    d = torch.randn(got.shape, generator=g, dtype=torch.float64)
    for p in parts:  # the loss never reads a run's padding, so its gradient there is zero
        d[p.start:p.stop, p.width:] = 0
    grads = torch.autograd.grad(got, [x, *a_s, *b_s], d)
    wants = torch.autograd.grad(want, [x, *a_s, *b_s], d)
    for name, gg, ww in zip(["x"] + [f"a{i}" for i in range(len(a_s))] + [f"b{i}" for i in range(len(b_s))], grads, wants):
        torch.testing.assert_close(gg, ww, rtol=1e-10, atol=1e-10, msg=name)
    # The gradients come out in each parameter's layout (fused CPU AdamW reads them in memory order).
    for p, gg in zip([*a_s, *b_s], grads[1:]):
        assert gg.stride() == p.stride()
    assert torch.autograd.gradcheck(lambda x_, *ab: LoraLinear.apply(x_, w, bias, parts, batched, *ab),
                                    (x, *a_s, *b_s))


def test_a_run_alone_slices_nothing_and_gets_the_same_bits(monkeypatch):
    """A run alone covers every row at full width: its node takes its rows (and sums into them) as
    views of the whole tensor, without a slice each (a dispatch apiece, ~1,400 a SmolLM2 pass of
    1 x 8 tokens), and gets the bits of the sliced path, forward and backward."""
    from benchmarks.launches import OpCount
    from tinkerd.engine.lora import fused

    def run():
        g = torch.Generator().manual_seed(2)
        x = torch.randn(B, T, IN, generator=g, requires_grad=True)
        w = torch.randn(OUT, IN, generator=g)
        parts = (Part(0, B, T, 2.0),)
        a_s, b_s = adapters(parts, dtype=torch.float32)
        with OpCount(views=True) as count:
            y = LoraLinear.apply(x, w, None, parts, False, *a_s, *b_s)
            grads = torch.autograd.grad(y, [x, *a_s, *b_s], torch.ones_like(y))
        return (y.detach(), *grads), count.ops

    fast, ops = run()
    assert "slice" not in ops
    monkeypatch.setattr(fused, "_whole", lambda t, p: False)
    sliced, sliced_ops = run()
    assert "slice" in sliced_ops
    assert all(torch.equal(a, b) for a, b in zip(fast, sliced))


def test_an_input_that_needs_no_gradient_gets_none_and_the_adapters_still_train():
    parts = (Part(0, B, T, 2.0),)
    x = torch.randn(B, T, IN, dtype=torch.float64)
    w = torch.randn(OUT, IN, dtype=torch.float64)
    a_s, b_s = adapters(parts)
    out = LoraLinear.apply(x, w, None, parts, False, *a_s, *b_s)
    g_a, g_b = torch.autograd.grad(out.sum(), [a_s[0], b_s[0]])
    w_a, w_b = torch.autograd.grad(reference(x, w, None, parts, a_s, b_s).sum(), [a_s[0], b_s[0]])
    torch.testing.assert_close(g_a, w_a)
    torch.testing.assert_close(g_b, w_b)


def test_the_parts_follow_the_routing_groups():
    from tinkerd.engine.lora.layers import LoraWeights, SlotGroup

    x = torch.zeros(5, 8, IN)
    lw = LoraWeights(torch.zeros(2, IN), torch.zeros(OUT, 2), 4.0)
    assert parts_of(x, [SlotGroup(0, None)], [lw]) == (Part(0, 5, 8, 4.0),)
    assert parts_of(x, [SlotGroup(0, None)], [None]) == ()
    groups = [SlotGroup(0, torch.arange(0, 2), 5, None), SlotGroup(1, torch.arange(2, 3), 5, 6),
              SlotGroup(2, torch.arange(3, 5), 5, 3)]
    assert parts_of(x, groups, [lw, None, lw]) == (Part(0, 2, 8, 4.0), Part(3, 5, 3, 4.0))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_runs_training_pass_takes_the_fused_node_on_every_adapted_linear_in_fp32(request, models_dir, monkeypatch,
                                                                                   dtype):
    """A forward_backward of one run alone: in fp32 every wrapped linear with the run's adapter is
    one LoraLinear node (the unembedding's runs in engine/head.py), each with that run as its one
    part; a bf16 base with fp32 master A/B keeps
    autograd's path (and so the sampler's training-path numbers there do not move)."""
    from tests.unit.engine.test_cotrain import alone
    from tests.unit.engine.test_training import BASE, sft_data
    from tinkerd.engine.engine import Engine
    from tinkerd.engine.lora import fused
    from tinkerd.engine.lora.layers import MultiLoraLinear
    from tinkerd.engine.precision import Precision
    from tinkerd.types import CreateModelOp, ForwardBackwardOp, LoraSpec

    engine = request.getfixturevalue("engine") if dtype == "float32" else Engine(models_dir, precision=Precision("cpu", dtype))
    rt = engine.load_base_model(BASE)
    model_id = f"fused-node-{dtype}"
    assert not isinstance(alone(engine, CreateModelOp(model_id, BASE, LoraSpec(rank=4, alpha=8.0, seed=3))), Exception)
    calls = []
    apply = fused.LoraLinear.apply
    monkeypatch.setattr(fused.LoraLinear, "apply", lambda x, w, bias, parts, together, *ab:
                        calls.append((parts, together)) or apply(x, w, bias, parts, together, *ab))
    result = alone(engine, ForwardBackwardOp(model_id, sft_data(7, lengths=(5, 9)), "cross_entropy"))
    assert not isinstance(result, Exception), result
    slot = rt.pool.get(model_id).slot
    head = rt.model.get_output_embeddings()  # the unembedding's LoRA runs in engine/head.py
    adapted = sum(1 for m in rt.model.modules() if isinstance(m, MultiLoraLinear) and slot in m.adapters and m is not head)
    assert adapted > 0
    if dtype == "float32":
        assert len(calls) == adapted
        assert {c for c in calls} == {((Part(0, 2, 9, 2.0),), False)}
    else:
        assert calls == []
