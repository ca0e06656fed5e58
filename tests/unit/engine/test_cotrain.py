"""Several runs' forward_backward in one pass (engine/cotrain.py) equals each run alone, bit for bit.

Each case trains twin adapters (same rank, alpha and seed, so the same initial weights): one twin
of every run alone, one op per step, the other twins with their ops side by side in one StepBatch,
which the engine runs as one pass (StepOutput.shared_passes says so: without the shared pass the
step would run them one by one and that assertion fails). fp32, one torch thread (tests/conftest.py).
"""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from tinkerd.engine import cotrain, finite, head
from tinkerd.errors import UserError
from tinkerd.types import AdamParams, CreateModelOp, Datum, ForwardBackwardOp, LoraSpec, OptimStepOp, StepBatch

from tests.unit.engine.test_training import BASE, assert_identical, sft_data

# Ranks, datum lengths and datum counts all differ between runs; one run trains no head LoRA.
RUNS = (
    ("r4", LoraSpec(rank=4, alpha=16.0, seed=11), (9, 13, 6, 11)),
    ("r8", LoraSpec(rank=8, alpha=32.0, seed=12), (21, 5)),
    ("r16", LoraSpec(rank=16, alpha=8.0, seed=13, train_unembed=False), (3, 17, 8)),
)
ADAM = AdamParams(learning_rate=1e-2)


def step(engine, ops):
    out = engine.step(StepBatch(run=[(f"t{i}", op) for i, op in enumerate(ops)]))
    done = dict(out.done)
    return [done[f"t{i}"] for i in range(len(ops))], out.shared_passes


def alone(engine, op):
    (result,), shared = step(engine, [op])
    assert shared == []
    return result


def state(engine, model_id: str) -> dict:
    adapter = engine.runtime_of(model_id).pool.get(model_id)
    return {"weights": {n: (a.detach().clone(), b.detach().clone()) for n, (a, b) in adapter.weights.items()},
            "grads": [None if t.grad is None else t.grad.clone() for t in adapter.parameters()],
            "pending_grads": adapter.pending_grads,
            # The bound on max |grad| the non-finite guard kept (engine/finite.py): a shared pass
            # measures all its runs' gradients at once (step_bounds.magnitudes), alone each its own.
            "grad_bound": adapter.extra.get(finite.GRAD_BOUND)}


def assert_same_result(ours, theirs) -> None:
    assert not isinstance(ours, Exception), ours
    assert ours.metrics == theirs.metrics  # loss:sum included, compared with ==
    assert len(ours.loss_fn_outputs) == len(theirs.loss_fn_outputs)
    for a, b in zip(ours.loss_fn_outputs, theirs.loss_fn_outputs):
        assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


def assert_each_as_alone(engine, solo: list[str], fused: list[str], data: list, together: list, label: str) -> None:
    """Each fused twin's result of a shared pass `==` its solo twin's op alone, and so are their
    states; then an optim_step of each (the fused ones in one step, the solo ones alone) and the
    states again."""
    for k, m in enumerate(solo):
        assert_same_result(together[k], alone(engine, ForwardBackwardOp(m, data[k], "cross_entropy")))
        assert_identical(state(engine, fused[k]), state(engine, m), f"{m} after {label}")
    step(engine, [OptimStepOp(m, ADAM) for m in fused])
    for k, m in enumerate(solo):
        alone(engine, OptimStepOp(m, ADAM))
        assert_identical(state(engine, fused[k]), state(engine, m), f"{m} after optim_step {label}")


def twins(engine, tag: str) -> tuple[list[str], list[str]]:
    solo, fused = [], []
    for name, spec, _ in RUNS:
        for ids in (solo, fused):
            model_id = f"{tag}-{name}-{len(ids)}-{'solo' if ids is solo else 'fused'}"
            assert not isinstance(alone(engine, CreateModelOp(model_id, BASE, spec)), Exception)
            ids.append(model_id)
    return solo, fused


def twins_of(engine, tag: str, specs: list[LoraSpec]) -> tuple[list[str], list[str]]:
    """(solo, fused) twin model ids, one pair per spec, created."""
    solo, fused = [], []
    for k, spec in enumerate(specs):
        for ids, kind in ((solo, "solo"), (fused, "fused")):
            ids.append(f"{tag}-{k}-{kind}")
            assert not isinstance(alone(engine, CreateModelOp(ids[-1], BASE, spec)), Exception)
    return solo, fused


def data_of(k: int, round_: int) -> list[Datum]:
    return sft_data(100 * round_ + k, lengths=RUNS[k][2])


def test_runs_in_one_pass_equal_each_alone_in_loss_logprobs_grads_and_weights(engine):
    solo, fused = twins(engine, "cotrain")
    for round_ in range(3):  # round 0 meets B = 0 (A's grads are 0); later rounds train everything
        mine = [ForwardBackwardOp(m, data_of(k, round_), "cross_entropy") for k, m in enumerate(fused)]
        together, shared = step(engine, mine)
        assert shared == [len(RUNS)]
        for k, m in enumerate(solo):
            assert_same_result(together[k], alone(engine, ForwardBackwardOp(m, data_of(k, round_), "cross_entropy")))
            assert_identical(state(engine, fused[k]), state(engine, m), f"{m} after round {round_}")
        results, shared = step(engine, [OptimStepOp(m, ADAM) for m in fused])
        assert shared == [] and all(r == {} for r in results)
        for k, m in enumerate(solo):
            alone(engine, OptimStepOp(m, ADAM))
            assert_identical(state(engine, fused[k]), state(engine, m), f"{m} after optim_step {round_}")
    # The runs really differ from one another, so a routing mix-up could not pass unnoticed.
    losses = [alone(engine, ForwardBackwardOp(m, data_of(0, 9), "cross_entropy", forward_only=True)).metrics["loss:sum"]
              for m in solo]
    assert len(set(losses)) == len(solo)


def test_forward_ops_of_several_runs_share_a_pass_and_change_nothing(engine):
    solo, fused = twins(engine, "cotrain-fwd")
    for m in solo + fused:  # trained once so that B != 0
        alone(engine, ForwardBackwardOp(m, data_of(0, 0), "cross_entropy"))
        alone(engine, OptimStepOp(m, ADAM))
    before = [state(engine, m) for m in fused]
    ops = [ForwardBackwardOp(m, data_of(k, 1), "cross_entropy", forward_only=True) for k, m in enumerate(fused)]
    together, shared = step(engine, ops)
    assert shared == [len(RUNS)]
    for k, m in enumerate(solo):
        assert_same_result(together[k], alone(engine, ForwardBackwardOp(m, data_of(k, 1), "cross_entropy",
                                                                         forward_only=True)))
        assert_identical(state(engine, fused[k]), before[k])


def test_a_bad_datum_fails_only_its_own_op_in_a_shared_pass(engine):
    solo, fused = twins(engine, "cotrain-bad")
    bad = [Datum(tokens=np.arange(8), loss_fn_inputs={"target_tokens": np.arange(1, 8)})]  # 7 targets for 8 tokens
    before = state(engine, fused[1])
    ops = [ForwardBackwardOp(fused[0], data_of(0, 0), "cross_entropy"),
           ForwardBackwardOp(fused[1], bad, "cross_entropy"),
           ForwardBackwardOp(fused[2], data_of(2, 0), "cross_entropy")]
    results, shared = step(engine, ops)
    assert isinstance(results[1], UserError) and "datum 0" in results[1].message
    assert_identical(state(engine, fused[1]), before)
    assert shared == [2]  # the other two still share their pass
    for k in (0, 2):
        assert_same_result(results[k], alone(engine, ForwardBackwardOp(solo[k], data_of(k, 0), "cross_entropy")))
        assert_identical(state(engine, fused[k]), state(engine, solo[k]))


def test_a_gradient_that_overflows_fails_only_its_own_op_in_a_batched_shared_pass(engine, monkeypatch):
    """Runs of one shape share each layer's batched GEMMs, so their gradients are slices of one
    tensor (step_bounds.magnitudes measures them together): a run whose gradient overflows (loss
    weights of 1e36: a finite loss, a non-finite gradient) is refused with the tensor named and its
    state untouched; the others equal their ops alone."""
    from tinkerd.engine.lora import fused as fused_linear

    calls = []
    apply = fused_linear.LoraLinear.apply
    monkeypatch.setattr(fused_linear.LoraLinear, "apply", lambda x, w, bias, parts, together, *ab:
                        (together and calls.append(len(parts))) or apply(x, w, bias, parts, together, *ab))
    solo, fused = twins_of(engine, "cotrain-overflow", [LoraSpec(rank=8, alpha=16.0, seed=30 + k) for k in range(3)])
    for m in solo + fused:  # B != 0, so every layer's A gets a gradient too
        alone(engine, ForwardBackwardOp(m, sft_data(7, lengths=(9, 13)), "cross_entropy"))
        alone(engine, OptimStepOp(m, ADAM))
    data = [sft_data(300 + k, lengths=(9, 13)) for k in range(3)]
    poison = dict(data[1][1].loss_fn_inputs, weights=np.full(13, 1e36, np.float32))
    data[1] = [data[1][0], Datum(data[1][1].tokens, poison)]
    before = state(engine, fused[1])
    results, shared = step(engine, [ForwardBackwardOp(m, data[k], "cross_entropy") for k, m in enumerate(fused)])
    assert shared == [3] and calls and set(calls) == {3}  # one pass, its layers' LoRA products batched
    assert isinstance(results[1], UserError), results[1]
    assert re.search(r"gradient of \S+\.lora_[AB] is (nan|-?inf)", results[1].message), results[1].message
    assert_identical(state(engine, fused[1]), before)
    for k in (0, 2):
        assert_same_result(results[k], alone(engine, ForwardBackwardOp(solo[k], data[k], "cross_entropy")))
        assert_identical(state(engine, fused[k]), state(engine, solo[k]))


def test_ops_of_one_run_and_other_ops_are_not_fused(engine):
    solo, _ = twins(engine, "cotrain-apart")
    a, b = solo[0], solo[1]
    ops = [ForwardBackwardOp(a, data_of(0, 0), "cross_entropy"), ForwardBackwardOp(a, data_of(0, 1), "cross_entropy"),
           OptimStepOp(a, ADAM), ForwardBackwardOp(b, data_of(1, 0), "cross_entropy"),
           ForwardBackwardOp(a, data_of(0, 2), "cross_entropy", forward_only=True)]
    results, shared = step(engine, ops)
    assert not any(isinstance(r, Exception) for r in results)
    assert shared == []
    assert torch.is_grad_enabled()


def test_an_op_under_min_tokens_runs_alone_and_the_rest_still_share(engine):
    solo, fused = twins(engine, "cotrain-tiny")
    tiny = sft_data(5, lengths=(3,))  # 3 tokens: MKL's small-GEMM kernel would round its rows differently
    ops = [ForwardBackwardOp(fused[0], tiny, "cross_entropy"), ForwardBackwardOp(fused[1], data_of(1, 0), "cross_entropy"),
           ForwardBackwardOp(fused[2], data_of(2, 0), "cross_entropy")]
    results, shared = step(engine, ops)
    assert shared == [2]
    assert_same_result(results[0], alone(engine, ForwardBackwardOp(solo[0], tiny, "cross_entropy")))
    for k in (1, 2):
        assert_same_result(results[k], alone(engine, ForwardBackwardOp(solo[k], data_of(k, 0), "cross_entropy")))


@pytest.fixture
def two_threads():
    """The engine at 2 torch threads for one test (MKL splits small GEMMs between threads)."""
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(1)


@pytest.mark.parametrize("path", ["onednn", "torch"])
def test_at_two_threads_an_op_whose_gemm_rows_round_otherwise_runs_alone(engine, two_threads, monkeypatch, path):
    """engine/rowbits.py: at 2 threads MKL gives a GEMM of 5-7 or 9-11 rows (AMD Zen 5), or of 17-128
    rows for some shapes (Intel Xeon), other bits than the same rows inside a bigger batch, so a
    6-token op that shared a pass (32 rows here) got other numbers than alone. The probe finds those
    row counts on the machine, for the GEMMs the pass runs (oneDNN's, or torch's with
    TINKERD_CPU_GEMM=torch); an op whose rows alone, or whose pass's, are among them runs alone, the
    others still share, a model whose odd rows do not settle shares nothing, and each op gets its
    bits alone whichever it is."""
    from tinkerd.engine import gemm
    from tinkerd.engine.lora import fused

    if path == "torch":
        monkeypatch.setattr(gemm, "onednn", lambda: False)
    elif not gemm.onednn():
        pytest.skip("oneDNN's linear is not in this torch build")
    fused.layout.cache_clear()
    rt = engine.runtime(BASE)
    monkeypatch.setattr(rt, "odd_rows_by_threads", {})
    odd = rt.odd_rows
    assert odd is None or 1 in odd  # both BLASes take another kernel for a row alone
    solo, together_ids = twins(engine, f"cotrain-2t-{path}")
    data = [sft_data(71, lengths=(6,)), sft_data(72, lengths=(8,)), sft_data(73, lengths=(8, 8))]
    ops = [ForwardBackwardOp(m, data[k], "cross_entropy") for k, m in enumerate(together_ids)]
    together, shared = step(engine, ops)
    assert shared == ([] if odd is None else [2] if odd & {6, 24} else [3])
    assert_each_as_alone(engine, solo, together_ids, data, together, f"a pass at 2 threads ({path})")
    fused.layout.cache_clear()


def test_layers_no_run_trains_take_onednns_gemms_alone_and_shared_and_keep_each_runs_bits(engine, two_threads, monkeypatch):
    """Runs trained without their MLP (and one without attention): in a pass those layers have no
    adapter of any run, and still take the fused node's GEMMs (oneDNN's, lora/fused.py: fits), as
    the same op alone does, so the probe checks only those for a wrapped linear (MKL's fp32 sgemm
    at 2 threads on an Intel Xeon rounds a row by the batch from 17 rows, and turned the whole model's
    shared passes off). The runs share one pass and each gets its bits alone."""
    from tinkerd.engine import gemm, rowbits

    if not gemm.onednn():
        pytest.skip("oneDNN's linear is not in this torch build")
    rt = engine.runtime(BASE)
    assert not [p for p in rowbits._probes(rt) if p[0] in ("the forward", "the input gradient")
                and p[2] == torch.float32]  # every fp32 linear of the tiny body is wrapped
    specs = [LoraSpec(rank=8, alpha=16.0, seed=21, train_mlp=False), LoraSpec(rank=4, alpha=8.0, seed=22, train_mlp=False),
             LoraSpec(rank=8, alpha=16.0, seed=23, train_attn=False, train_mlp=False)]
    solo, together_ids = twins_of(engine, "cotrain-nomlp", specs)
    data = [sft_data(91 + k, lengths=(16, 12)) for k in range(len(specs))]
    weights = []
    linear = gemm._linear
    monkeypatch.setattr(gemm, "_linear", lambda x, w, b: weights.append(w.data_ptr()) or linear(x, w, b))
    together, shared = step(engine, [ForwardBackwardOp(m, data[k], "cross_entropy") for k, m in enumerate(together_ids)])
    assert shared == [len(specs)]
    down = [layer.base.weight.data_ptr() for name, layer in rt.layers.items() if name.endswith("down_proj")]
    # The untrained MLP's GEMMs were oneDNN's: forward x W^T and input gradient d W (W^T, the same memory).
    assert all(weights.count(ptr) == 2 for ptr in down), [weights.count(ptr) for ptr in down]
    monkeypatch.setattr(gemm, "_linear", linear)
    assert_each_as_alone(engine, solo, together_ids, data, together, "a pass without MLP adapters")
    # Runs that train only the head: nothing of the body to differentiate, alone or shared.
    heads = [LoraSpec(rank=8, alpha=16.0, seed=24 + k, train_attn=False, train_mlp=False) for k in range(2)]
    solo, together_ids = twins_of(engine, "cotrain-head", heads)
    together, shared = step(engine, [ForwardBackwardOp(m, data[k], "cross_entropy") for k, m in enumerate(together_ids)])
    assert shared == [2]
    assert_each_as_alone(engine, solo, together_ids, data[:2], together, "a pass of head adapters")


def test_the_probe_sends_ops_of_odd_row_counts_alone_and_turns_a_model_off_when_they_do_not_settle(engine, monkeypatch):
    """A BLAS faked inside the probe: one that rounds GEMMs of 5 or 6 rows another way keeps 8-token
    ops sharing and sends 5- and 6-token ones alone; one that does so for every 5th row count turns
    the model's shared passes off. No op is refused either way."""
    from tinkerd.engine import gemm, rowbits

    rt = engine.runtime(BASE)
    forwards = {rowbits: rowbits._forward, gemm: gemm.linear}  # torch's, and oneDNN's (the fused node's)

    def skewed(forward, odd_if):
        def product(x, w, b=None):
            y = forward(x, w, b)
            return y.add(1e-3) if odd_if(x.shape[0]) else y
        return product

    solo, _ = twins(engine, "cotrain-odd")
    for odd_if, found, expected in ((lambda m: m in (5, 6), {5, 6}, [1, 1, 2]), (lambda m: m % 5 == 0, None, [1, 1, 1, 1])):
        monkeypatch.setattr(rowbits, "_forward", skewed(forwards[rowbits], odd_if))
        monkeypatch.setattr(gemm, "linear", skewed(forwards[gemm], odd_if))
        monkeypatch.setattr(rt, "odd_rows_by_threads", {})
        ops = [ForwardBackwardOp(m, sft_data(81 + k, lengths=(n,)), "cross_entropy")
               for k, (m, n) in enumerate(((solo[0], 5), (solo[1], 6), (solo[2], 8), (solo[0], 8)))]
        assert rt.odd_rows is None if found is None else found <= rt.odd_rows  # with the BLAS's own (1 row, ...)
        assert [len(p) for p in cotrain.passes(engine, [(str(i), op) for i, op in enumerate(ops)])] == expected


def test_the_heads_gemm_rows_are_the_ones_its_pass_runs():
    """head.gemm_rows (what cotrain checks against the probe) packs blocks as HeadPass does."""
    from types import SimpleNamespace

    for ms in ([8], [8, 8, 8, 8], [300, 300], [5, 700, 12], [1025, 3, 511, 2]):
        spans = head.HeadPass._gemm_blocks(SimpleNamespace(parts=[(m, None) for m in ms]))
        assert head.gemm_rows(ms) == [span.stop - span.start for span, _ in spans]


@pytest.mark.parametrize("row_block, keep", [(512, True), (64, True), (64, False), (16, True)])
def test_the_runs_share_the_heads_gemms_and_each_gets_its_bits_alone(engine, monkeypatch, row_block, keep):
    """The head runs once over every run's rows (engine/head.py): each tile's GEMM takes the
    consecutive blocks of several runs (one with a head LoRA next to one without) while they fit in
    ROW_BLOCK rows, and each run still gets the bits of its op alone, logits kept or recomputed.
    The runs have 39, 26 and 28 positions: at 512 rows one GEMM per tile serves all three; at 64
    the first run fills one alone and the other two share the next; at 16 no two blocks fit one."""
    monkeypatch.setattr(head, "ROW_BLOCK", row_block)
    monkeypatch.setattr(head, "TILE_CELLS", row_block * 40_000)  # 4 tiles of the tiny model's 151,669 tokens
    if not keep:
        monkeypatch.setattr(head, "KEEP_CELLS", 0)
    calls = []
    logits = head.HeadPass._logits
    monkeypatch.setattr(head.HeadPass, "_logits", lambda self, x, *a: calls.append(x.shape[0]) or logits(self, x, *a))
    solo, fused = twins(engine, f"cotrain-head-{row_block}-{keep}")
    mine = [ForwardBackwardOp(m, data_of(k, 0), "cross_entropy") for k, m in enumerate(fused)]
    calls.clear()
    together, shared = step(engine, mine)
    gemms = {512: [93], 64: [39, 54], 16: [13, 13, 13, 13, 13, 14, 14]}[row_block]
    assert shared == [len(RUNS)]
    assert calls == [rows for rows in gemms for _ in range(4)] * (1 if keep else 2)
    for k, m in enumerate(solo):
        assert_same_result(together[k], alone(engine, ForwardBackwardOp(m, data_of(k, 0), "cross_entropy")))
        assert_identical(state(engine, fused[k]), state(engine, m), m)


def test_off_the_tiled_path_each_run_keeps_its_own_head(engine, monkeypatch):
    """A head off the tiled path (bf16, a softcap, a bias: engine/head.py) runs run by run in the
    shared pass, each through autograd on its own rows, and each run still gets its bits alone."""
    monkeypatch.setattr(head, "tiled", lambda *a: False)
    solo, fused = twins(engine, "cotrain-own-head")
    mine = [ForwardBackwardOp(m, data_of(k, 0), "cross_entropy") for k, m in enumerate(fused)]
    together, shared = step(engine, mine)
    assert shared == [len(RUNS)]
    for k, m in enumerate(solo):
        assert_same_result(together[k], alone(engine, ForwardBackwardOp(m, data_of(k, 0), "cross_entropy")))
        assert_identical(state(engine, fused[k]), state(engine, m), m)


@pytest.fixture(scope="module")
def bf16_engine(models_dir):
    """A `--dtype bfloat16` engine: bf16 base, fp32 master adapters cast for each pass."""
    from tinkerd.engine.engine import Engine
    from tinkerd.engine.precision import Precision

    eng = Engine(models_dir, precision=Precision("cpu", "bfloat16"))
    eng.load_base_model(BASE)
    return eng


@pytest.mark.parametrize("alphas, batched_layers, dtype, rank", [((8.0, 32.0, 16.0), True, "float32", 8),
                                                                 ((8.0, 12.0, 16.0), False, "float32", 8),
                                                                 ((32.0, 32.0, 32.0), None, "float32", 1),
                                                                 ((8.0, 32.0, 16.0), True, "bfloat16", 8),
                                                                 ((16.0, 16.0, 16.0), True, "bfloat16", 8)])
def test_runs_of_one_shape_take_each_layers_deltas_in_batched_gemms_and_keep_their_bits(request, monkeypatch, alphas,
                                                                                       batched_layers, dtype, rank):
    """Runs whose blocks have the same rows, width and rank (engine/lora/batched.py) get every
    layer's LoRA deltas from one batched GEMM per product, and each its bits alone: results,
    gradients and weights after two rounds, with powers-of-two scalings 1, 4 and 2 (or all 2). A
    scaling of 1.5 (PEFT scales the output then) keeps the per-run GEMMs. At rank 1 MKL's mm takes a
    matrix-vector kernel whose bits a batched GEMM may not keep: the probe on the machine decides
    (batched.keeps_bits, fused.keeps_bits; before it, rank-1 runs that shared a pass lost their bits
    alone), and either way each run gets its bits alone. In
    fp32 the batched GEMMs sum into the base output (engine/lora/fused.py: baddbmm_ against each run's
    addmm_ alone); in bf16 the fp32 master A/B are cast for the pass and their gradients cast back, as
    alone."""
    from tinkerd.engine.lora import batched, fused as fused_linear

    engine = request.getfixturevalue("engine" if dtype == "float32" else "bf16_engine")

    calls = []
    if dtype == "float32":
        apply = fused_linear.LoraLinear.apply
        monkeypatch.setattr(fused_linear.LoraLinear, "apply",
                            lambda x, w, bias, parts, together, *ab: (together and calls.append(len(parts)))
                            or apply(x, w, bias, parts, together, *ab))
    else:
        deltas = batched.same_shape_deltas
        monkeypatch.setattr(batched, "same_shape_deltas", lambda x, loras: calls.append(len(loras)) or deltas(x, loras))
    specs = [LoraSpec(rank=rank, alpha=alpha, seed=20 + k, train_unembed=k != 2) for k, alpha in enumerate(alphas)]
    solo, fused = [], []
    for k, spec in enumerate(specs):
        for ids, kind in ((solo, "solo"), (fused, "fused")):
            ids.append(f"cotrain-same-{dtype}-{alphas}-{rank}-{k}-{kind}")
            assert not isinstance(alone(engine, CreateModelOp(ids[-1], BASE, spec)), Exception)
    for round_ in range(2):  # round 0: B = 0, so A's gradients are 0; round 1 trains everything
        data = [sft_data(200 + 10 * round_ + k, lengths=(9, 13)) for k in range(len(specs))]
        calls.clear()
        together, shared = step(engine, [ForwardBackwardOp(m, data[k], "cross_entropy") for k, m in enumerate(fused)])
        assert shared == [len(specs)]
        if batched_layers is not None:  # None: the machine's probe decides (fused.keeps_bits), bits hold either way
            assert (calls and set(calls) == {len(specs)}) if batched_layers else calls == []
        assert_each_as_alone(engine, solo, fused, data, together, f"round {round_}")


def test_the_batched_path_asks_keeps_bits_on_the_cpu_only(monkeypatch):
    """On the CPU batched.fits takes a shape only once keeps_bits says its bits hold; elsewhere (CUDA,
    here the meta device) no bits are promised and nothing is probed."""
    from types import SimpleNamespace

    from tinkerd.engine.lora import batched

    asked = []
    monkeypatch.setattr(batched, "keeps_bits", lambda *a: asked.append(a) or False)
    groups = [SimpleNamespace(rows=torch.zeros(2), width=None)] * 2
    loras = [SimpleNamespace(a=torch.zeros(4, 8), b=torch.zeros(16, 4), scaling=2.0)] * 2
    assert not batched.fits(torch.zeros(4, 5, 8), groups, loras)
    assert asked == [(2, 10, 8, 16, 4, (2.0, 2.0), torch.float32, torch.float32, torch.get_num_threads())]
    assert batched.fits(torch.zeros(4, 5, 8, device="meta"), groups, loras) and len(asked) == 1


def test_runs_of_one_shape_keep_their_bits_with_d_b_per_run(engine, monkeypatch):
    """The batched layout in which only the backward's d B runs per run (fused.D_B_APART: MKL at 2
    threads on an Intel Xeon rounds SmolLM2's [8, 1536] x [1536, 32] another way in bmm than in mm),
    taken by every layer the probe batches: each run's results, gradients and weights equal its op
    alone over two rounds, as in the all-bmm layout."""
    from tinkerd.engine.lora import fused as fused_linear

    used, batched_calls = [], []
    monkeypatch.setattr(fused_linear, "layout_for", lambda *a: used.append(1) or fused_linear.D_B_APART)
    apply = fused_linear.LoraLinear.apply
    monkeypatch.setattr(fused_linear.LoraLinear, "apply", lambda x, w, bias, parts, together, *ab:
                        (together is True and batched_calls.append(1)) or apply(x, w, bias, parts, together, *ab))
    specs = [LoraSpec(rank=8, alpha=alpha, seed=40 + k) for k, alpha in enumerate((8.0, 32.0, 16.0))]
    solo, fused = twins_of(engine, "cotrain-d-b-apart", specs)
    for round_ in range(2):
        data = [sft_data(500 + 10 * round_ + k, lengths=(9, 13)) for k in range(len(specs))]
        used.clear()
        batched_calls.clear()
        together, shared = step(engine, [ForwardBackwardOp(m, data[k], "cross_entropy") for k, m in enumerate(fused)])
        assert shared == [len(specs)]
        assert batched_calls and len(used) == len(batched_calls)  # every batched layer took the layout
        assert_each_as_alone(engine, solo, fused, data, together, f"d B per run, round {round_}")


def test_the_layout_probe_takes_all_bmm_first_then_d_b_per_run_then_none(monkeypatch):
    """fused.layout: BMM where it keeps every run's bits, else D_B_APART where that does, else None
    (the layer runs per run); keeps_bits is whether there is one. Here a layout "misses" by a
    perturbed output."""
    from tinkerd.engine.lora import fused as fused_linear

    apply = fused_linear.LoraLinear.apply
    missing: set = set()

    def perturbed(x, w, bias, parts, batched, *ab):
        out = apply(x, w, bias, parts, batched, *ab)
        return out * (1 + 2.0 ** -20) if batched in missing else out

    monkeypatch.setattr(fused_linear.LoraLinear, "apply", perturbed)
    key = (2, 8, 16, 24, 8, (1.0, 1.0), torch.float32, torch.float32, torch.get_num_threads())
    for miss, want in (((), fused_linear.BMM), ((fused_linear.BMM,), fused_linear.D_B_APART),
                       ((fused_linear.BMM, fused_linear.D_B_APART), None)):
        fused_linear.layout.cache_clear()
        missing.clear()
        missing.update(miss)
        assert fused_linear.layout(*key) == want, miss
        assert fused_linear.keeps_bits(*key) == (want is not None)
    fused_linear.layout.cache_clear()


def test_consecutive_runs_of_one_width_share_an_attention_call_and_keep_their_bits(engine, monkeypatch):
    """Runs of one width and the same mask need take one SDPA call per layer (grouped.attention_calls):
    two unpadded runs of width 12 share one, a padded run of width 12 gets its own (it needs the
    mask, they do not), a run of width 7 its own; each run keeps the bits of its op alone."""
    from transformers.integrations import sdpa_attention

    lengths = ((12, 12), (12, 12), (9, 12), (7,))
    specs = [LoraSpec(rank=4 * (k + 1), alpha=16.0, seed=30 + k) for k in range(len(lengths))]
    solo, fused = twins_of(engine, "cotrain-attn", specs)
    calls = []
    forward = sdpa_attention.sdpa_attention_forward
    monkeypatch.setattr(sdpa_attention, "sdpa_attention_forward",
                        lambda m, q, k, v, mask, **kw: calls.append((q.shape[0], q.shape[2], mask is None))
                        or forward(m, q, k, v, mask, **kw))
    data = [sft_data(300 + k, lengths=n) for k, n in enumerate(lengths)]
    together, shared = step(engine, [ForwardBackwardOp(m, data[k], "cross_entropy") for k, m in enumerate(fused)])
    assert shared == [len(specs)]
    layers = engine.runtime_of(fused[0]).model.config.num_hidden_layers
    assert calls == [(4, 12, True), (2, 12, False), (1, 7, True)] * layers
    for k, m in enumerate(solo):
        assert_same_result(together[k], alone(engine, ForwardBackwardOp(m, data[k], "cross_entropy")))
        assert_identical(state(engine, fused[k]), state(engine, m), m)


def test_a_sliding_window_that_bites_keeps_a_runs_attention_call_masked():
    from tinkerd.engine.grouped import AttentionGroup, attention_calls

    groups = [AttentionGroup(2, 12, False), AttentionGroup(1, 12, False), AttentionGroup(1, 12, True)]
    assert attention_calls(groups, None, None) == [(4, 12, True)]  # no mask at all: one call
    mask = torch.ones(4, 1, 12, 12, dtype=torch.bool)
    assert attention_calls(groups, mask, None) == [(3, 12, True), (1, 12, False)]
    assert attention_calls(groups, mask, 8) == [(4, 12, False)]  # the window bites every run


def test_bf16_right_padded_runs_attend_row_by_row_and_keep_their_bits(bf16_engine, monkeypatch):
    """With AMX a bf16 attention of right-padded rows wider than causal.KEY_BLOCK runs each row
    alone at its own length (engine/causal.py): in a shared pass a padded run's rows take those
    calls as its op alone does, and every run keeps its bits alone."""
    from tests.unit.engine.cpus import pin
    from tinkerd.engine import causal

    pin(monkeypatch, "intel")
    rows = []
    by_row = causal._by_row
    monkeypatch.setattr(causal, "_by_row", lambda m, q, k, v, lengths, kw: rows.append(tuple(lengths)) or by_row(m, q, k, v, lengths, kw))
    width = causal.KEY_BLOCK
    lengths = [(width + 20, width + 4), (width + 10,)]
    specs = [LoraSpec(rank=4, alpha=16.0, seed=60 + k) for k in range(len(lengths))]
    solo, fused = twins_of(bf16_engine, "cotrain-bf16-rows", specs)
    data = [sft_data(500 + k, lengths=n) for k, n in enumerate(lengths)]
    together, shared = step(bf16_engine, [ForwardBackwardOp(m, data[k], "cross_entropy") for k, m in enumerate(fused)])
    assert shared == [len(specs)]
    layers = bf16_engine.runtime_of(fused[0]).model.config.num_hidden_layers
    assert rows == [lengths[0]] * layers  # the padded run's rows; the other run has no mask
    assert_each_as_alone(bf16_engine, solo, fused, data, together, "bf16 rows one by one")
    assert rows == [lengths[0]] * 2 * layers  # alone, the same calls


@pytest.mark.parametrize("lengths,column,blocks", [(((100, 96), (64, 64), (90,)), "amd", "CausalBlocks"),
                                                   (((240, 230), (224, 224), (250,)), "amd", "GemmBlocks"),
                                                   (((240, 230), (224, 224), (250,)), "intel", "CausalBlocks"),
                                                   (((1540, 1530), (1536, 1536)), "intel", "CausalBlocks")])
def test_runs_wide_enough_for_causal_query_blocks_keep_their_bits(engine, monkeypatch, lengths, column, blocks):
    """From 64 tokens attention runs in causal query blocks cut from the width (engine/causal.py,
    from 224 as oneDNN GEMMs, engine/causal_gemm.py, where the CPU's MKL is not AVX-512: engine/cpu.py),
    except, on Intel, an unpadded run from causal.PLAIN_FROM tokens (the kernel's one call): each
    run's call at its own width, padded or not, gives the bits of its op alone."""
    from tests.unit.engine.cpus import pin
    from tinkerd.engine import causal, causal_gemm

    pin(monkeypatch, column)

    specs = [LoraSpec(rank=4 * (k + 1), alpha=16.0, seed=40 + k) for k in range(len(lengths))]
    solo, fused = twins_of(engine, f"cotrain-{blocks}-{column}-{lengths[0][0]}", specs)
    widths = []
    for fn in (causal.CausalBlocks, causal_gemm.GemmBlocks):
        apply = fn.apply
        monkeypatch.setattr(fn, "apply", lambda q, *a, fn=fn, apply=apply: widths.append((fn.__name__, q.shape[2]))
                            or apply(q, *a))
    data = [sft_data(400 + k, lengths=n) for k, n in enumerate(lengths)]
    together, shared = step(engine, [ForwardBackwardOp(m, data[k], "cross_entropy") for k, m in enumerate(fused)])
    assert shared == [len(specs)]
    # On Intel an unpadded run from PLAIN_FROM tokens takes the kernel's one call.
    calls = [(blocks, n[0]) for n in lengths if not (column == "intel" and len(set(n)) == 1 and n[0] >= causal.PLAIN_FROM)]
    assert len(calls) < len(lengths) if lengths[0][0] >= causal.PLAIN_FROM else len(calls) == len(lengths)
    assert widths == calls * engine.runtime_of(fused[0]).model.config.num_hidden_layers
    assert_each_as_alone(engine, solo, fused, data, together, "a pass in query blocks")
