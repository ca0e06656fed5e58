"""Training through Engine.step with domain ops: learning, accumulation, isolation, resume, errors."""

from __future__ import annotations

import copy
import json
import re

import numpy as np
import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

from tinkerd.engine import checkpoints
from tinkerd.errors import NotFoundError, UserError
from tinkerd.types import (
    AdamParams,
    CreateModelOp,
    Datum,
    ForwardBackwardOp,
    ForwardBackwardResult,
    LoadWeightsOp,
    LoraSpec,
    OptimStepOp,
    SaveWeightsOp,
    UnloadModelOp,
)

BASE = "tinkerd/tiny-qwen3"
ADAM = AdamParams(learning_rate=1e-3)
# Adam's first steps are ~lr·sign(g): an element whose gradient is near zero turns fp32 rounding
# noise into an lr-sized difference. eps=1 makes the update Lipschitz in g (constant lr/eps), so two
# runs whose gradients agree to fp32 noise must agree in weights to ~1e-7.
SMOOTH_ADAM = AdamParams(learning_rate=1e-2, eps=1.0)


def run(engine, op):
    (result,) = engine.run_ops([op])
    if isinstance(result, Exception):
        raise result
    return result


def create(engine, model_id: str, seed: int = 0, rank: int = 8) -> None:
    run(engine, CreateModelOp(model_id, BASE, LoraSpec(rank=rank, alpha=32.0, seed=seed)))


def sft_datum(seq: np.ndarray) -> Datum:
    weights = np.ones(len(seq) - 1, np.float32)
    return Datum(tokens=seq[:-1], loss_fn_inputs={"target_tokens": seq[1:], "weights": weights})


def sft_data(seed: int, lengths=(9, 13, 6, 11)) -> list[Datum]:
    rng = np.random.default_rng(seed)
    return [sft_datum(rng.integers(0, 150_000, n + 1)) for n in lengths]


def train_step(engine, model_id: str, data: list[Datum], adam: AdamParams = ADAM) -> float:
    result = run(engine, ForwardBackwardOp(model_id, data, "cross_entropy"))
    run(engine, OptimStepOp(model_id, adam))
    return result.metrics["loss:sum"]


def adapter_of(engine, model_id: str):
    return engine.runtime_of(model_id).pool.get(model_id)


def snapshot(adapter) -> dict:
    return {
        "weights": {n: (a.detach().clone(), b.detach().clone()) for n, (a, b) in adapter.weights.items()},
        "grads": [None if t.grad is None else t.grad.clone() for t in adapter.parameters()],
        "optimizer": copy.deepcopy(adapter.optimizer.state_dict()),
        "step": adapter.step,
        "pending_grads": adapter.pending_grads,
    }


def assert_identical(a, b, path="adapter") -> None:
    """Bit-identical nested structures of tensors, dicts, lists and plain values."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), path
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), path
        for k in a:
            assert_identical(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            assert_identical(x, y, f"{path}[{i}]")
    else:
        assert a == b, path


def busy(engine, model_id: str, seed: int = 0) -> None:
    """A model mid-run: trained once (optimizer state exists) and holding pending grads."""
    create(engine, model_id, seed=seed)
    data = sft_data(seed)
    train_step(engine, model_id, data)
    run(engine, ForwardBackwardOp(model_id, data[:2], "cross_entropy"))
    assert adapter_of(engine, model_id).pending_grads == 1


def test_sft_loss_falls(engine):
    create(engine, "sft", seed=1)
    data = sft_data(1, lengths=(16,))
    losses = [train_step(engine, "sft", data) for _ in range(20)]
    assert losses[-1] < 0.3 * losses[0], losses
    assert sum(b < a for a, b in zip(losses, losses[1:])) >= 17, losses
    adapter = adapter_of(engine, "sft")
    assert adapter.step == 20 and adapter.pending_grads == 0
    assert all(t.grad is None for t in adapter.parameters())  # zeroed with set_to_none


def assert_close_scaled(ours: torch.Tensor, reference: torch.Tensor, tol: float) -> None:
    """|ours − reference| ≤ tol · max(1, max|reference|)."""
    scale = max(1.0, reference.abs().max().item())
    assert (ours - reference).abs().max().item() <= tol * scale


def test_two_half_batches_equal_one_full_batch(engine):
    data = sft_data(2)
    create(engine, "accum-halves", seed=2)
    create(engine, "accum-full", seed=2)
    h, f = adapter_of(engine, "accum-halves"), adapter_of(engine, "accum-full")
    for _ in range(2):  # the second round moves A too (its grad is exactly 0 while B is 0)
        halves = [run(engine, ForwardBackwardOp("accum-halves", d, "cross_entropy")) for d in (data[:2], data[2:])]
        full = run(engine, ForwardBackwardOp("accum-full", data, "cross_entropy"))
        assert sum(r.metrics["loss:sum"] for r in halves) == pytest.approx(full.metrics["loss:sum"], rel=1e-6)
        assert (h.pending_grads, f.pending_grads) == (2, 1)
        # Different GEMM shapes (2 rows vs 4) round differently: measured ≤ 2e-6 of the largest grad.
        for th, tf in zip(h.parameters(), f.parameters()):
            assert_close_scaled(th.grad, tf.grad, 1e-5)
        run(engine, OptimStepOp("accum-halves", SMOOTH_ADAM))
        run(engine, OptimStepOp("accum-full", SMOOTH_ADAM))
        for th, tf in zip(h.parameters(), f.parameters()):
            torch.testing.assert_close(th, tf, rtol=0, atol=1e-6)
    assert all(b.abs().max() > 1e-3 for _, b in h.weights.values())  # training really moved every B


def test_forward_only_changes_nothing(engine):
    busy(engine, "fwd-only", seed=3)
    adapter = adapter_of(engine, "fwd-only")
    before = snapshot(adapter)
    data = sft_data(33)
    result = run(engine, ForwardBackwardOp("fwd-only", data, "cross_entropy", forward_only=True))
    assert_identical(snapshot(adapter), before)
    # Same numbers as the forward of a training call on the same state.
    trained = run(engine, ForwardBackwardOp("fwd-only", data, "cross_entropy"))
    assert result.metrics == trained.metrics
    for a, b in zip(result.loss_fn_outputs, trained.loss_fn_outputs):
        np.testing.assert_array_equal(a["logprobs"], b["logprobs"])


def test_two_adapters_on_one_base_are_isolated(engine):
    busy(engine, "iso-a", seed=4)
    busy(engine, "iso-b", seed=5)
    a, b = adapter_of(engine, "iso-a"), adapter_of(engine, "iso-b")
    assert a.slot != b.slot
    before_b, before_a = snapshot(b), snapshot(a)
    for _ in range(3):
        train_step(engine, "iso-a", sft_data(6), AdamParams(learning_rate=1e-2, weight_decay=0.1, grad_clip_norm=1.0))
    engine.run_ops([ForwardBackwardOp("iso-a", [sft_data(6)[0], Datum(np.array([10**9]), {})], "cross_entropy")])
    assert_identical(snapshot(b), before_b)
    moved = snapshot(a)["weights"]
    assert any(not torch.equal(moved[n][1], before_a["weights"][n][1]) for n in moved)


def test_save_with_optimizer_then_resume_is_exact(engine, tmp_path):
    adam = AdamParams(learning_rate=5e-3, weight_decay=0.01, grad_clip_norm=0.5)
    data = sft_data(7)
    create(engine, "resume", seed=7)
    for _ in range(3):
        train_step(engine, "resume", data, adam)
    ckpt = tmp_path / "ckpt-3"
    saved = run(engine, SaveWeightsOp("resume", str(ckpt), with_optimizer=True))
    assert saved["size_bytes"] > 0
    assert (ckpt / checkpoints.OPTIMIZER_FILE).is_file()
    uninterrupted = [train_step(engine, "resume", data, adam) for _ in range(3)]
    final = snapshot(adapter_of(engine, "resume"))["weights"]

    # Into a new model_id (create-via-load: the LoRA spec comes from the checkpoint).
    run(engine, LoadWeightsOp("resume-loaded", BASE, str(ckpt), with_optimizer=True))
    loaded = adapter_of(engine, "resume-loaded")
    assert loaded.spec == adapter_of(engine, "resume").spec and loaded.step == 3
    assert [train_step(engine, "resume-loaded", data, adam) for _ in range(3)] == uninterrupted
    assert_identical(snapshot(loaded)["weights"], final)

    # In place, into the model that kept training: back to step 3, then the same three steps again.
    run(engine, LoadWeightsOp("resume", BASE, str(ckpt), with_optimizer=True))
    assert adapter_of(engine, "resume").step == 3
    assert [train_step(engine, "resume", data, adam) for _ in range(3)] == uninterrupted

    # Without the optimizer: the weights come back, Adam starts fresh.
    run(engine, LoadWeightsOp("resume-fresh", BASE, str(ckpt), with_optimizer=False))
    fresh = adapter_of(engine, "resume-fresh")
    assert fresh.step == 0 and not fresh.optimizer.state
    files = checkpoints.read_adapter(ckpt)
    assert_identical({n: (a.detach(), b.detach()) for n, (a, b) in fresh.weights.items()}, files.weights)


def test_load_refuses_other_base_model_and_missing_optimizer(engine, tmp_path):
    create(engine, "ckpt-src", seed=8)
    run(engine, SaveWeightsOp("ckpt-src", str(tmp_path / "sampler"), with_optimizer=False))
    (other_base,) = engine.run_ops([LoadWeightsOp("ckpt-other", "tinkerd/tiny-llama", str(tmp_path / "sampler"), False)])
    assert isinstance(other_base, UserError) and "tinkerd/tiny-qwen3" in other_base.message
    (no_optim,) = engine.run_ops([LoadWeightsOp("ckpt-other", BASE, str(tmp_path / "sampler"), True)])
    assert isinstance(no_optim, UserError) and "no optimizer state" in no_optim.message
    (missing,) = engine.run_ops([LoadWeightsOp("ckpt-other", BASE, str(tmp_path / "nothing"), False)])
    assert isinstance(missing, NotFoundError)
    assert "ckpt-other" not in engine.model_of


@pytest.fixture(scope="module")
def victim(engine) -> str:
    busy(engine, "victim", seed=9)
    return "victim"


def _good() -> Datum:
    return sft_data(10, lengths=(5,))[0]


def _with(**inputs) -> Datum:
    d = _good()
    return Datum(tokens=inputs.pop("tokens", d.tokens), loss_fn_inputs={**d.loss_fn_inputs, **inputs})


# case -> (the second datum of a [good, bad] batch, expected message). Datum 0 is valid, so a
# half-accumulated gradient from it would show up in the unchanged-adapter check.
BAD_DATUMS = {
    "token id >= vocab": (lambda: _with(tokens=np.array([1, 2, 151_669])), r"datum 1: token id 151669"),
    "negative token id": (lambda: _with(tokens=np.array([1, -3, 2, 4, 5])), r"datum 1: token id -3"),
    "target id >= vocab": (lambda: _with(target_tokens=np.array([1, 2, 3, 4, 10**6])), r"datum 1: target token id 1000000"),
    "targets length mismatch": (lambda: _with(target_tokens=np.arange(4)), r"datum 1: target_tokens has shape \[4\]"),
    "weights length mismatch": (lambda: _with(weights=np.ones(6, np.float32)), r"datum 1: weights has shape \[6\]"),
    "nan weights": (lambda: _with(weights=np.array([1, np.nan, 1, 1, 1], np.float32)), r"datum 1: weights contains NaN"),
    "missing target_tokens": (lambda: Datum(np.arange(5), {}), r"datum 1: .*requires loss_fn_inputs \['target_tokens'\]"),
    "unknown input key": (lambda: _with(advantages=np.ones(5, np.float32)), r"datum 1: .*\['advantages'\] are not used"),
    "context too long": (lambda: sft_datum(np.ones(4098, np.int64)), r"datum 1: 4097 tokens exceed .* 4096"),
    "empty datum": (lambda: Datum(np.zeros(0, np.int64), {"target_tokens": np.zeros(0, np.int64)}), r"datum 1: .*non-empty"),
}
BAD_OPS = {
    **{case: (lambda bad=bad: [_good(), bad()], "cross_entropy", msg) for case, (bad, msg) in BAD_DATUMS.items()},
    "empty data": (lambda: [], "cross_entropy", r"at least one datum"),
    "unknown loss": (lambda: [_good()], "ppo_typo", r"'ppo_typo' is not supported .*cross_entropy"),
}


@pytest.mark.parametrize("case", sorted(BAD_OPS))
def test_bad_forward_backward_is_a_user_error_and_changes_nothing(engine, victim, case):
    data, loss_fn, message = BAD_OPS[case]
    adapter = adapter_of(engine, victim)
    before = snapshot(adapter)
    (result,) = engine.run_ops([ForwardBackwardOp(victim, data(), loss_fn)])
    assert isinstance(result, UserError) and result.category == "user", result
    assert result.status_code == 400
    assert re.search(message, result.message), result.message
    assert_identical(snapshot(adapter), before)


def test_bad_optim_step_and_unknown_model(engine, victim):
    adapter = adapter_of(engine, victim)
    before = snapshot(adapter)
    (bad_beta,) = engine.run_ops([OptimStepOp(victim, AdamParams(beta1=1.0))])
    assert isinstance(bad_beta, UserError) and "beta1" in bad_beta.message
    assert_identical(snapshot(adapter), before)
    unknown = (ForwardBackwardOp("nobody", [_good()], "cross_entropy"), OptimStepOp("nobody", ADAM), UnloadModelOp("nobody"))
    for op in unknown:
        (result,) = engine.run_ops([op])
        assert isinstance(result, NotFoundError), op


def test_unload_frees_the_model_id(engine):
    create(engine, "short-lived", seed=11)
    slot = adapter_of(engine, "short-lived").slot
    run(engine, UnloadModelOp("short-lived"))
    assert "short-lived" not in engine.model_of
    assert all(slot not in layer.adapters for layer in engine.runtime(BASE).layers.values())
    create(engine, "short-lived", seed=11)  # the id can be reused


def test_saved_files_load_into_peft_with_the_same_logits(engine, tiny_runtime, tiny_model_dir, tmp_path):
    create(engine, "export", seed=12)
    for _ in range(3):  # non-zero B everywhere, so the LoRA path matters
        train_step(engine, "export", sft_data(12), AdamParams(learning_rate=1e-2))
    out = tmp_path / "export"
    run(engine, SaveWeightsOp("export", str(out), with_optimizer=False))
    assert not (out / checkpoints.OPTIMIZER_FILE).exists()
    config = json.loads((out / checkpoints.CONFIG_FILE).read_text())
    assert (config["peft_type"], config["task_type"]) == ("LORA", "CAUSAL_LM")
    assert (config["r"], config["lora_alpha"], config["lora_dropout"], config["bias"]) == (8, 32.0, 0.0, "none")

    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    reference = PeftModel.from_pretrained(base, out).eval()
    tokens = torch.from_numpy(np.random.default_rng(13).integers(0, 150_000, (2, 10)))
    adapter = adapter_of(engine, "export")
    tiny_runtime.ctx.set_single(adapter.slot)
    try:
        with torch.no_grad():
            ours = tiny_runtime.model(input_ids=tokens).logits
    finally:
        tiny_runtime.ctx.clear()
    with torch.no_grad():
        theirs = reference(input_ids=tokens).logits
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    with torch.no_grad(), reference.disable_adapter():
        plain = reference(input_ids=tokens).logits
    assert (ours - plain).abs().max() > 1e-3  # the adapter was really applied by PEFT
