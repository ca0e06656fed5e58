"""The engine on CUDA (`--device cuda`) against the same ops on the CPU, for every tiny family.

Skipped on machines without CUDA (CI has none): run on a lent GPU machine, see docs/testing.md.
What it pins there:
- every family trains (forward_backward + optim_step, two rounds) in fp32 and bf16, and its losses
  and per-token logprobs agree with the CPU engine on the same adapter (fp32: to fp32 rounding;
  bf16: to bf16 rounding of a CPU bf16 run);
- the RL losses run on the device;
- sampling from the trained weights on the device returns the CPU's greedy tokens (fp32);
- a shared pass of several runs (engine/cotrain.py) gives each run what it gets alone, to rounding
  (bit for bit on the CPU only);
- an op alone repeats to the bit (what recovery's replay needs);
- a GRPO group's shared prompt run once (engine/prefixes.py) agrees with the CPU's plain pass.

The first GPU run found an fp32 forward_backward that failed on CUDA (engine/head.py built a
tensor on the CPU): bf16 never takes that path, so the SDK loop in bf16 had hidden it.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from tinkerd.engine.engine import Engine
from tinkerd.engine.precision import Precision
from tinkerd.engine.sampler.sample import run_sample
from tinkerd.types import (AdamParams, CreateModelOp, Datum, ForwardBackwardOp, LoraSpec, OptimStepOp, SampleOp,
                           SamplingParams, SaveWeightsOp, StepBatch)

from tests import grpo

# TINKERD_TEST_DEVICE=cpu runs the same checks CPU against CPU: a dry run of this file's own logic.
DEVICE = os.environ.get("TINKERD_TEST_DEVICE", "cuda")
pytestmark = pytest.mark.skipif(DEVICE == "cuda" and not torch.cuda.is_available(), reason="needs a CUDA device")

FAMILIES = ["tinkerd/tiny-qwen3", "tinkerd/tiny-llama", "tinkerd/tiny-qwen3-moe", "tinkerd/tiny-qwen3.5",
            "tinkerd/tiny-qwen3.5-moe", "tinkerd/tiny-gpt-oss", "tinkerd/tiny-qwen3-vl"]
ADAM = AdamParams(learning_rate=1e-2, eps=1.0)  # eps=1: updates Lipschitz in the grads (test_training.py)
# Relative agreement of a loss between the two devices: fp32 differs by summation order only; a
# bf16 run on each device rounds every activation, with the devices' own kernels.
LOSS_RTOL = {"float32": 1e-4, "bfloat16": 3e-2}
LOGPROB_ATOL = {"float32": 1e-3, "bfloat16": 0.25}
SHARED_RTOL = {"float32": 1e-5, "bfloat16": 2e-2}


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    models = tmp_path_factory.mktemp("cuda-models")
    return {(device, dtype): Engine(models, precision=Precision(device, dtype))
            for device in ("cpu", DEVICE) for dtype in ("float32", "bfloat16")}


def run(engine: Engine, op):
    out = engine.step(StepBatch(run=[("op", op)]))
    (result,) = [r for key, r in out.done if key == "op"]
    if isinstance(result, Exception):
        raise result
    return result


def train(engine: Engine, base: str, model_id: str, rounds: int = 2) -> list:
    engine.load_base_model(base)
    run(engine, CreateModelOp(model_id, base, LoraSpec(rank=8, alpha=16.0, seed=5)))
    out = []
    for r in range(rounds):
        out.append(run(engine, ForwardBackwardOp(model_id, sft_data(40 + r), "cross_entropy")))
        run(engine, OptimStepOp(model_id, ADAM))
    return out


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("base", FAMILIES)
def test_a_family_trains_on_cuda_as_on_the_cpu(engines, base, dtype):
    tag = f"{base.rsplit('/', 1)[1]}-{dtype}"
    on_cpu = train(engines["cpu", dtype], base, f"cpu-{tag}")
    on_gpu = train(engines[DEVICE, dtype], base, f"gpu-{tag}-2")
    for r, (c, g) in enumerate(zip(on_cpu, on_gpu)):
        assert np.isfinite(g.metrics["loss:sum"]), (r, g.metrics)
        assert g.metrics["loss:sum"] == pytest.approx(c.metrics["loss:sum"], rel=LOSS_RTOL[dtype]), r
        for a, b in zip(c.loss_fn_outputs, g.loss_fn_outputs):
            np.testing.assert_allclose(b["logprobs"], a["logprobs"], atol=LOGPROB_ATOL[dtype])
    # Round 2 saw round 1's update on both devices: the optimizer moved the weights alike.
    assert on_gpu[1].metrics["loss:sum"] != on_gpu[0].metrics["loss:sum"]


def sft_data(seed: int, lengths=(9, 13, 6, 11)) -> list[Datum]:
    # tests/unit/engine/test_training.py's, not imported: that module imports PEFT, which a GPU
    # machine's own Python may hold in a version that does not import with this transformers.
    rng = np.random.default_rng(seed)
    return [Datum(tokens=seq[:-1], loss_fn_inputs={"target_tokens": seq[1:], "weights": np.ones(n, np.float32)})
            for n, seq in ((n, rng.integers(0, 150_000, n + 1)) for n in lengths)]


def rl_data(seed: int, loss_fn: str) -> list[Datum]:
    rng = np.random.default_rng(seed)
    out = []
    for d in sft_data(seed):
        n = len(d.tokens)
        q = (-rng.uniform(0.5, 8.0, n)).astype(np.float32)
        inputs = {"target_tokens": d.loss_fn_inputs["target_tokens"], "advantages": rng.normal(size=n).astype(np.float32)}
        if loss_fn == "gspo":
            inputs["sequence_ratio_mask"] = np.ones(n, np.float32)
        if loss_fn != "stable_reinforce":  # it reads the server's record of the sampler's logprobs
            inputs["logprobs"] = q
        out.append(Datum(tokens=d.tokens, loss_fn_inputs=inputs,
                         sampler_logprobs=q if loss_fn == "stable_reinforce" else None))
    return out


@pytest.mark.parametrize("loss_fn", ["importance_sampling", "ppo", "cispo", "dro", "gspo", "stable_reinforce"])
def test_rl_losses_run_on_cuda_as_on_the_cpu(engines, loss_fn):
    base, got = "tinkerd/tiny-qwen3", {}
    for device in ("cpu", DEVICE):
        engine = engines[device, "float32"]
        engine.load_base_model(base)
        model_id = f"{device}-rl-{loss_fn}-{len(got)}"
        run(engine, CreateModelOp(model_id, base, LoraSpec(rank=8, alpha=16.0, seed=6)))
        config = {"beta": 0.1} if loss_fn == "dro" else {}
        first = run(engine, ForwardBackwardOp(model_id, rl_data(3, loss_fn), loss_fn, config))
        run(engine, OptimStepOp(model_id, ADAM))
        got[device, len(got)] = (first, run(engine, ForwardBackwardOp(model_id, rl_data(4, loss_fn), loss_fn, config)))
    (on_cpu, on_gpu) = got.values()
    for c, g in zip(on_cpu, on_gpu):
        assert g.metrics["loss:sum"] == pytest.approx(c.metrics["loss:sum"], rel=1e-4, abs=1e-5)


@pytest.mark.parametrize("base", ["tinkerd/tiny-qwen3", "tinkerd/tiny-qwen3.5", "tinkerd/tiny-qwen3-moe"])
def test_sampling_the_trained_weights_on_cuda_gives_the_cpus_greedy_tokens(engines, base, tmp_path):
    prompt = np.array([9707, 11, 1879, 0, 220, 3555, 13, 1416], dtype=np.int64)
    got = {}
    for device in ("cpu", DEVICE):
        engine = engines[device, "float32"]
        model_id = f"{device}-sample-{base.rsplit('/', 1)[1]}-{len(got)}"
        train(engine, base, model_id)
        path = str(tmp_path / model_id)
        run(engine, SaveWeightsOp(model_id, path, with_optimizer=False))
        op = SampleOp(base_model=base, adapter_path=path, prompt=prompt, num_samples=2, prompt_logprobs=True,
                      params=SamplingParams(max_tokens=8, temperature=0.0, stop_at_eos=False))
        got[device, len(got)] = run_sample(engine, op)
    on_cpu, on_gpu = got.values()
    for c, g in zip(on_cpu.sequences, on_gpu.sequences):
        assert g.tokens == c.tokens
        np.testing.assert_allclose(g.logprobs, c.logprobs, atol=1e-3)
    np.testing.assert_allclose(np.nan_to_num(on_gpu.prompt_logprobs), np.nan_to_num(on_cpu.prompt_logprobs),
                               atol=1e-3)


@pytest.mark.parametrize("shapes", ["mixed", "same", "moe", "gpt_oss", "hybrid"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_shared_pass_on_cuda_gives_each_run_what_it_gets_alone_to_rounding(engines, dtype, shapes, monkeypatch):
    """On the CPU a shared pass keeps each run's bits (tests/unit/engine/test_cotrain.py). On CUDA it
    does not: cuBLAS picks kernels by shapes, strides and alignment, so a run's rows inside a larger
    pass can round differently (the first GPU run: round 0 equal, round 1 off by 1-4 ulp in fp32).
    What holds there is agreement to rounding, after optim_steps too. Runs of one shape take the
    batched LoRA GEMMs (engine/lora/batched.py), on CUDA too. "moe": the mixed runs on a Qwen3-MoE
    (on a GPU one GEMM per expert for all runs' tokens, engine/lora/experts.py), fp32 only: in bf16 a
    router logit rounded another way can send a token to another expert; "gpt_oss" likewise (its
    eager attention with sinks per run, grouped.grouped_attention). "hybrid": the mixed runs
    on a Qwen3.5 (each run's Gated DeltaNet layers on its own rows, grouped.grouped_linear_attention)."""
    from tinkerd.engine.lora import batched

    if shapes in ("moe", "gpt_oss") and dtype == "bfloat16":
        pytest.skip("bf16 rounding can change a token's experts between the two passes")
    calls = []
    deltas = batched.same_shape_deltas
    monkeypatch.setattr(batched, "same_shape_deltas", lambda x, loras: calls.append(len(loras)) or deltas(x, loras))
    base = {"moe": "tinkerd/tiny-qwen3-moe", "gpt_oss": "tinkerd/tiny-gpt-oss",
            "hybrid": "tinkerd/tiny-qwen3.5"}.get(shapes, "tinkerd/tiny-qwen3")
    engine = engines[DEVICE, dtype]
    engine.load_base_model(base)
    if shapes != "same":
        specs = [LoraSpec(rank=4, alpha=16.0, seed=11), LoraSpec(rank=8, alpha=32.0, seed=12),
                 LoraSpec(rank=8, alpha=16.0, seed=13, train_unembed=False)]
        lengths = [(9, 13, 6, 11), (21, 5), (3, 17, 8)]
    else:
        specs = [LoraSpec(rank=8, alpha=alpha, seed=11 + k) for k, alpha in enumerate((16.0, 32.0, 8.0))]
        lengths = [(9, 13)] * 3
    ids = {}
    for mode in ("solo", "fused"):
        for k, spec in enumerate(specs):
            ids[mode, k] = f"shared-{dtype}-{shapes}-{mode}-{k}"
            run(engine, CreateModelOp(ids[mode, k], base, spec))
    for round_ in range(2):
        ops = [(f"f{k}", ForwardBackwardOp(ids["fused", k], sft_data(100 * round_ + k, lengths[k]), "cross_entropy"))
               for k in range(len(specs))]
        calls.clear()
        out = engine.step(StepBatch(run=ops))
        assert out.shared_passes == [len(specs)]
        assert bool(calls) == (shapes == "same")
        fused = dict(out.done)
        for k in range(len(specs)):
            alone = run(engine, ForwardBackwardOp(ids["solo", k], sft_data(100 * round_ + k, lengths[k]), "cross_entropy"))
            mine = fused[f"f{k}"]
            assert mine.metrics["loss:sum"] == pytest.approx(alone.metrics["loss:sum"], rel=SHARED_RTOL[dtype]), (round_, k)
            for a, b in zip(mine.loss_fn_outputs, alone.loss_fn_outputs):
                np.testing.assert_allclose(a["logprobs"], b["logprobs"], rtol=SHARED_RTOL[dtype], err_msg=f"{round_}, {k}")
        for mode in ("solo", "fused"):
            for k in range(len(specs)):
                run(engine, OptimStepOp(ids[mode, k], ADAM))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("base", ["tinkerd/tiny-qwen3", "tinkerd/tiny-qwen3.5", "tinkerd/tiny-qwen3-moe"])
def test_an_op_alone_on_cuda_repeats_to_the_bit(engines, base, dtype):
    """Recovery replays a run's logged ops (docs/architecture.md §4) and promises the uninterrupted
    run's losses and weights: twin adapters given the same ops one at a time must agree bit for bit,
    which CUDA kernels with atomics (some attention backwards, scatter-adds) would break."""
    engine = engines[DEVICE, dtype]
    tag = f"{base.rsplit('/', 1)[1]}-{dtype}"
    a, b = train(engine, base, f"repeat-{tag}-a"), train(engine, base, f"repeat-{tag}-b")
    for r, (x, y) in enumerate(zip(a, b)):
        assert x.metrics == y.metrics, r
        for p, q in zip(x.loss_fn_outputs, y.loss_fn_outputs):
            assert np.array_equal(p["logprobs"], q["logprobs"]), r
    pool = engine.runtime(base).pool
    for name, (wa, wb) in pool.get(f"repeat-{tag}-a").weights.items():
        twin = pool.get(f"repeat-{tag}-b").weights[name]
        assert torch.equal(wa, twin[0]) and torch.equal(wb, twin[1]), name


def test_a_forward_backward_whose_gradient_overflows_is_refused_on_cuda(engines):
    """The non-finite guard (engine/finite.py) on the device, where it checks the gradients with one
    foreach norm instead of a sum per tensor: the op fails as a user error and the adapter keeps
    no pending gradient."""
    from tinkerd.errors import UserError

    engine = engines[DEVICE, "float32"]
    base = "tinkerd/tiny-qwen3"
    engine.load_base_model(base)
    run(engine, CreateModelOp("overflow", base, LoraSpec(rank=8, alpha=16.0, seed=5)))
    good, bad = sft_data(50)[:2]
    inputs = dict(bad.loss_fn_inputs)
    inputs["weights"] = np.full_like(inputs["weights"], 1e36)  # the loss fits fp32, its gradient not
    with pytest.raises(UserError, match=r"gradient of \S+\.lora_[AB] is|loss is"):
        run(engine, ForwardBackwardOp("overflow", [good, Datum(bad.tokens, inputs)], "cross_entropy"))
    assert engine.runtime(base).pool.get("overflow").pending_grads == 0


def grpo_data(seed: int, prompt: int = 40, samples: int = 6) -> list[Datum]:
    rng = np.random.default_rng(seed)
    return [Datum(tokens=t, loss_fn_inputs=i) for t, i in grpo.samples(rng, rng.integers(0, 150_000, prompt), samples, (4, 12))]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_grpo_group_runs_its_prompt_once_on_cuda_as_on_the_cpu(engines, dtype, monkeypatch):
    """engine/prefixes.py on the device (its KV cache, the selected prefix rows per datum), with and
    without the sharing, against the CPU's plain pass."""
    from tinkerd.engine import prefixes

    base, data, got = "tinkerd/tiny-qwen3", grpo_data(9), {}
    assert prefixes.plan(data) is not None
    saved = prefixes.MIN_SAVED
    for k, device in enumerate(("cpu", DEVICE)):
        engine = engines[device, dtype]
        engine.load_base_model(base)
        for shared in (True, False):
            monkeypatch.setattr(prefixes, "MIN_SAVED", saved if shared else 2.0)
            model_id = f"{device}-prefix-{dtype}-{k}-{shared}"
            run(engine, CreateModelOp(model_id, base, LoraSpec(rank=8, alpha=16.0, seed=7)))
            got[device, shared] = run(engine, ForwardBackwardOp(model_id, data, "importance_sampling"))
    want = got["cpu", False]
    for key, result in got.items():
        assert result.metrics["loss:sum"] == pytest.approx(want.metrics["loss:sum"], rel=LOSS_RTOL[dtype], abs=1e-5), key
        for a, b in zip(want.loss_fn_outputs, result.loss_fn_outputs):
            np.testing.assert_allclose(b["logprobs"], a["logprobs"], atol=LOGPROB_ATOL[dtype])
