"""Several runs' forward_backward in one pass (engine/cotrain.py) on a Qwen3-MoE and on a hybrid
Qwen3.5 equals each run alone.

As test_cotrain.py for a dense model: twin adapters, one of each pair trained alone, the other side
by side in one StepBatch. On the MoE each run's tokens on an expert run as their own GEMMs
(engine/lora/experts.py: MultiLoraExperts._run_tokens); on Qwen3.5 each run's Gated DeltaNet layers
run on its own rows at its own width (grouped.grouped_linear_attention). So each run's loss,
logprobs, gradients, weights and router metrics keep the bits of its op alone; the rest of the body
and the head span the runs. fp32, one thread.
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.parity.peft_oracle import loaded_engine
from tests.unit.engine.test_cotrain import alone, assert_each_as_alone, assert_same_result, state, step
from tests.unit.engine.test_training import assert_identical, sft_data
from tinkerd.engine.sampler.sample import run_sample
from tinkerd.types import AdamParams, CreateModelOp, ForwardBackwardOp, LoraSpec, OptimStepOp, SampleOp, SamplingParams

MOE = "tinkerd/tiny-qwen3-moe"
HYBRID = "tinkerd/tiny-qwen3.5"
GPT_OSS = "tinkerd/tiny-gpt-oss"
ADAM = AdamParams(learning_rate=1e-2)
# Ranks, lengths and datum counts differ (so rows are padded); one run has no MLP / expert LoRA.
RUNS = (
    (LoraSpec(rank=4, alpha=8.0, seed=41), (9, 13, 6)),
    (LoraSpec(rank=2, alpha=4.0, seed=42), (17, 5)),
    (LoraSpec(rank=4, alpha=16.0, seed=43, train_mlp=False), (11,)),
)


@pytest.fixture(scope="module")
def moe_engine(models_dir):
    return loaded_engine(models_dir, MOE)


@pytest.fixture(scope="module")
def hybrid_engine(models_dir):
    return loaded_engine(models_dir, HYBRID)


def greedy(engine, base: str) -> tuple[list[int], list[float]]:
    """The base model's greedy continuation of a prompt (longer than gpt-oss's sliding window)."""
    op = SampleOp(base, None, np.arange(100, 124, dtype=np.int64), SamplingParams(max_tokens=6, temperature=0.0))
    seq = run_sample(engine, op).sequences[0]
    return list(seq.tokens), list(seq.logprobs)


def twins(engine, tag: str, base: str = MOE) -> tuple[list[str], list[str]]:
    solo, fused = [], []
    for k, (spec, _) in enumerate(RUNS):
        for ids, kind in ((solo, "solo"), (fused, "fused")):
            ids.append(f"{tag}-{k}-{kind}")
            assert not isinstance(alone(engine, CreateModelOp(ids[-1], base, spec)), Exception)
    return solo, fused


@pytest.fixture(scope="module")
def gpt_oss_engine(models_dir):
    return loaded_engine(models_dir, GPT_OSS)


@pytest.mark.parametrize("base", [MOE, GPT_OSS])
def test_moe_runs_in_one_pass_equal_each_alone_in_loss_grads_weights_and_routing_metrics(request, base):
    """Qwen3-MoE, and gpt-oss: its eager attention with sinks and sliding-window layers run per run too
    (grouped.grouped_attention, always with the mask its op alone gets)."""
    moe_engine = request.getfixturevalue("moe_engine" if base == MOE else "gpt_oss_engine")
    sampled = greedy(moe_engine, base)  # before the model's attention is switched for shared passes
    solo, fused = twins(moe_engine, f"moe-cotrain-{base}", base)
    for round_ in range(3):  # round 0: B = 0; later rounds train every expert's LoRA too
        data = [sft_data(500 + 10 * round_ + k, lengths=lengths) for k, (_, lengths) in enumerate(RUNS)]
        together, shared = step(moe_engine, [ForwardBackwardOp(m, data[k], "cross_entropy") for k, m in enumerate(fused)])
        assert shared == [len(RUNS)]
        assert all("e_frac_with_tokens:mean" in r.metrics for r in together)  # routing metrics compared too
        assert_each_as_alone(moe_engine, solo, fused, data, together, f"round {round_}")
    # Sampling after the switch (grouped attention outside a pass is the model's own) is unchanged.
    assert greedy(moe_engine, base) == sampled
    # The runs' routing differs (their own tokens), so mixed-up counts could not pass unnoticed.
    # (The tiny gpt-oss routes every run's tokens alike.)
    metrics = {tuple(sorted((k, v) for k, v in r.metrics.items() if k.startswith("e_"))) for r in together}
    assert len(metrics) > 1 or base == GPT_OSS


def test_moe_forward_ops_share_a_pass_and_change_nothing(moe_engine):
    solo, fused = twins(moe_engine, "moe-cotrain-fwd")
    for m in solo + fused:  # trained once so that B != 0
        alone(moe_engine, ForwardBackwardOp(m, sft_data(7, lengths=(8, 12)), "cross_entropy"))
        alone(moe_engine, OptimStepOp(m, ADAM))
    before = [state(moe_engine, m) for m in fused]
    data = [sft_data(600 + k, lengths=lengths) for k, (_, lengths) in enumerate(RUNS)]
    ops = [ForwardBackwardOp(m, data[k], "cross_entropy", forward_only=True) for k, m in enumerate(fused)]
    together, shared = step(moe_engine, ops)
    assert shared == [len(RUNS)]
    for k, m in enumerate(solo):
        assert_same_result(together[k], alone(moe_engine, ForwardBackwardOp(m, data[k], "cross_entropy", forward_only=True)))
        assert_identical(state(moe_engine, fused[k]), before[k])


def test_on_a_gpu_an_experts_tokens_of_all_runs_share_its_gemms_and_agree_to_rounding(moe_engine, monkeypatch):
    """Where a shared pass keeps no bits (a GPU: lora/experts.py split_runs), an expert's tokens of
    all runs go through it as one GEMM, each token's delta by its run's slot: forced here on the
    CPU, each run agrees with its op alone to fp32 rounding, routing metrics exactly (the router is
    the same GEMM either way)."""
    from tinkerd.engine.lora import experts

    monkeypatch.setattr(experts, "split_runs", lambda device: False)
    seen = []
    expert = experts.MultiLoraExperts._expert
    monkeypatch.setattr(experts.MultiLoraExperts, "_expert",
                        lambda self, e, h, idx, *a: seen.append(len(a[2])) or expert(self, e, h, idx, *a))
    solo, fused = twins(moe_engine, "moe-cotrain-gpu")
    for round_ in range(2):
        data = [sft_data(700 + 10 * round_ + k, lengths=lengths) for k, (_, lengths) in enumerate(RUNS)]
        seen.clear()
        together, shared = step(moe_engine, [ForwardBackwardOp(m, data[k], "cross_entropy") for k, m in enumerate(fused)])
        assert shared == [len(RUNS)] and max(seen) > 1  # some expert's GEMM served several runs' slots
        for k, m in enumerate(solo):
            mine = alone(moe_engine, ForwardBackwardOp(m, data[k], "cross_entropy"))
            ours = together[k]
            assert {n: v for n, v in ours.metrics.items() if n.startswith("e_")} == \
                {n: v for n, v in mine.metrics.items() if n.startswith("e_")}
            assert ours.metrics["loss:sum"] == pytest.approx(mine.metrics["loss:sum"], rel=1e-5)
            for a, b in zip(ours.loss_fn_outputs, mine.loss_fn_outputs):
                np.testing.assert_allclose(a["logprobs"], b["logprobs"], rtol=1e-5, atol=1e-6)
        step(moe_engine, [OptimStepOp(m, ADAM) for m in fused])
        for m in solo:
            alone(moe_engine, OptimStepOp(m, ADAM))


def test_hybrid_runs_in_one_pass_equal_each_alone_with_each_runs_deltanet_layers_its_own(hybrid_engine):
    """Qwen3.5 (Gated DeltaNet and full-attention layers): each run's linear-attention layers run on
    its rows at its own width (the calls recorded), and its results and state equal its op alone."""
    base = HYBRID
    widths = []
    sampled = greedy(hybrid_engine, base)  # before the layers are switched for shared passes
    solo, fused = twins(hybrid_engine, f"hybrid-cotrain-{base}", base)
    rt = hybrid_engine.runtime_of(fused[0])
    layers = [m for m in rt.model.modules() if type(m).__name__.endswith("GatedDeltaNet")]
    assert layers
    for round_ in range(3):
        data = [sft_data(800 + 10 * round_ + k, lengths=lengths) for k, (_, lengths) in enumerate(RUNS)]
        together, shared = step(hybrid_engine, [ForwardBackwardOp(m, data[k], "cross_entropy") for k, m in enumerate(fused)])
        assert shared == [len(RUNS)]
        if round_ == 0:  # installed on the first shared pass: record the widths each layer ran at from now on
            for layer in layers:
                inner = layer.forward
                layer.forward = lambda *a, _inner=inner, **kw: widths.append(
                    [g.width for g in kw.get("tinkerd_attention_groups") or []]) or _inner(*a, **kw)
        assert_each_as_alone(hybrid_engine, solo, fused, data, together, f"round {round_}")
    assert [w for w in widths if w] == [[13, 17, 11]] * len(layers) * 2  # rounds 1 and 2, every layer
    assert greedy(hybrid_engine, base) == sampled  # outside a shared pass a layer is its own forward
