"""A training pass that recomputes its layers' activations in the backward (engine/recompute.py)
gives every number of the pass that keeps them, to the bit, and holds a fraction of the memory.

Twin adapters (same spec, so the same initial weights) train on the same ops, one with a budget no
pass reaches, the other with a budget of 0 (every decoder call recomputes); fp32, one thread."""

from __future__ import annotations

import ctypes
import shutil
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from tests import grpo
from tests.parity.peft_oracle import loaded_engine
from tests.unit.engine.test_cotrain import assert_same_result, state, step
from tests.unit.engine.test_training import assert_identical, sft_data, sft_datum
from tinkerd.engine import buckets, head, malloc, prefixes, recompute, training
from tinkerd.engine.engine import Engine
from tinkerd.engine.lora.experts import MultiLoraExperts
from tinkerd.engine.model.tiny import qwen3_tokenizer_dir
from tinkerd.engine.precision import Precision
from tinkerd.types import AdamParams, CreateModelOp, Datum, ForwardBackwardOp, LoraSpec, OptimStepOp

NEVER = 10**15
ADAM = AdamParams(learning_rate=1e-2)


def _grpo(seed: int) -> list[Datum]:
    rng = np.random.default_rng(seed)
    return [Datum(tokens=t, loss_fn_inputs=i) for p in (40, 28)
            for t, i in grpo.samples(rng, rng.integers(0, 150_000, p), 4, (6, 11))]


def _train(engine, model_id: str, budget: int, ops: list[tuple[list[Datum], str]]) -> tuple[list, int]:
    """Each op's forward_backward result then an optim_step, under `budget`; and how many decoder calls recomputed."""
    rt = engine.runtime_of(model_id)
    before, rt.recompute.budget = rt.recompute.calls, budget
    try:
        results = []
        for data, loss in ops:
            (fb,), _ = step(engine, [ForwardBackwardOp(model_id, data, loss)])
            (opt,), _ = step(engine, [OptimStepOp(model_id, ADAM)])
            assert not isinstance(fb, Exception) and not isinstance(opt, Exception), (fb, opt)
            results.append(fb)
        return results, rt.recompute.calls - before
    finally:
        rt.recompute.budget = None


def _twins(engine, base: str, name: str, ops, calls: int) -> None:
    for suffix in ("keep", "recompute"):
        engine.run_ops([CreateModelOp(f"{name}-{suffix}", base, LoraSpec(rank=4, alpha=8.0, seed=7))])
    kept, none = _train(engine, f"{name}-keep", NEVER, ops)
    replayed, made = _train(engine, f"{name}-recompute", 0, ops)
    assert (none, made) == (0, calls)
    for a, b in zip(replayed, kept):
        assert_same_result(a, b)
    assert_identical(state(engine, f"{name}-recompute"), state(engine, f"{name}-keep"))


@pytest.mark.parametrize("engine_name", ["engine", "bf16_session_engine"])
def test_a_dense_models_plain_prefix_shared_and_bucketed_passes_keep_their_bits(request, engine_name):
    """One padded batch (one decoder call), GRPO groups sharing their prompts (the prompts' call writes
    the KV cache the samples' call appends to: two calls), and datums in length buckets (one call each);
    in fp32 and in bf16 (the replay runs under the forward's autocast)."""
    engine = request.getfixturevalue(engine_name)
    plain = sft_data(1)
    shared = _grpo(2)
    spread = sft_data(3, lengths=(360, 24, 80, 350, 18, 120))  # four buckets
    assert prefixes.plan(shared) is not None and buckets.plan([len(d.tokens) for d in spread]) is not None
    _twins(engine, "tinkerd/tiny-qwen3", "dense", [(plain, "cross_entropy"), (shared, "importance_sampling"),
                                                    (spread, "cross_entropy")], calls=1 + 2 + 4)


def test_a_pass_short_of_a_little_memory_replays_some_layers_with_the_same_bits(engine):
    data = sft_data(11, lengths=(30, 41, 17))  # one padded batch: 3 x 41 positions
    for suffix in ("keep", "some"):
        engine.run_ops([CreateModelOp(f"partial-{suffix}", "tinkerd/tiny-qwen3", LoraSpec(rank=4, alpha=8.0, seed=9))])
    kept, _ = _train(engine, "partial-keep", NEVER, [(data, "cross_entropy")] * 2)
    rt = engine.runtime("tinkerd/tiny-qwen3")
    before = rt.recompute.replayed
    replayed, calls = _train(engine, "partial-some", int(_holds(rt, 3 * 41, kept=1)) + 8, [(data, "cross_entropy")] * 2)
    assert calls == 2 and rt.recompute.replayed - before == 2  # one layer of the two, in each of the two passes
    for a, b in zip(replayed, kept):
        assert_same_result(a, b)
    assert_identical(state(engine, "partial-some"), state(engine, "partial-keep"))


@pytest.mark.parametrize("base", ["tinkerd/tiny-qwen3-moe", "tinkerd/tiny-qwen3.5"])
def test_moe_and_hybrid_models_keep_their_bits_and_routing_metrics(models_dir, base):
    """An MoE's router metrics count each token once (the replay does not count again); Qwen3.5's
    Gated DeltaNet layers replay too."""
    engine = loaded_engine(models_dir, base)
    ops = [(sft_data(4), "cross_entropy"), (_grpo(5), "importance_sampling")]
    _twins(engine, base, "family", ops, calls=2)
    if "moe" in base:  # the last pass counted each MoE layer's routing once, the replays not at all
        rt = engine.runtime(base)
        experts = sum(isinstance(m, MultiLoraExperts) for m in rt.model.modules())
        assert experts > 0 and [len(c) for c in rt.routing.counts] == [experts]


def test_a_pass_shared_by_runs_replays_each_runs_layers_with_its_adapter(engine):
    """engine/cotrain.py clears the LoRA context after the shared forward; the replay puts it back."""
    def runs(suffix: str, budget: int):
        ids = [f"shared-{suffix}-{k}" for k in range(2)]
        for k, model_id in enumerate(ids):
            engine.run_ops([CreateModelOp(model_id, "tinkerd/tiny-qwen3", LoraSpec(rank=4 * (k + 1), alpha=8.0, seed=k))])
        rt = engine.runtime_of(ids[0])
        rt.recompute.budget, before = budget, rt.recompute.calls
        try:
            results, shared = step(engine, [ForwardBackwardOp(ids[0], sft_data(7), "cross_entropy"),
                                            ForwardBackwardOp(ids[1], sft_data(8, lengths=(12, 3)), "cross_entropy")])
        finally:
            rt.recompute.budget = None
        assert shared == [2]
        return results, [state(engine, i) for i in ids], rt.recompute.calls - before

    kept, kept_state, none = runs("keep", NEVER)
    replayed, replayed_state, made = runs("recompute", 0)
    assert (none, made) == (0, 1)
    for a, b in zip(replayed, kept):
        assert_same_result(a, b)
    assert_identical(replayed_state, kept_state)


def _held(engine, model_id: str, data, budget: int, monkeypatch) -> int:
    """Bytes of the process's heap in use more after the decoder's forward than before it."""
    rt, held = engine.runtime_of(model_id), []
    real = training._hidden

    def measured(*args, **kwargs):
        start = _in_use()
        hidden = real(*args, **kwargs)
        held.append(_in_use() - start)
        return hidden

    monkeypatch.setattr(training, "_hidden", measured)
    rt.recompute.budget = budget
    try:
        (fb,), _ = step(engine, [ForwardBackwardOp(model_id, data, "cross_entropy")])
    finally:
        rt.recompute.budget = None
        monkeypatch.setattr(training, "_hidden", real)
    assert not isinstance(fb, Exception), fb
    return held[0]


class _MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in
                "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]


def _in_use() -> int:
    """Bytes the process's malloc heaps hand out now (glibc's mallinfo2)."""
    libc = malloc._libc()
    libc.mallinfo2.restype = _MallInfo2
    return int(libc.mallinfo2().uordblks)


def test_a_recomputing_pass_holds_its_layers_inputs_alone(engine, monkeypatch):
    """4 x 256 tokens on the tiny Qwen3: what the forward leaves for the backward, measured in the heap."""
    if malloc._libc() is None or not hasattr(malloc._libc(), "mallinfo2"):
        pytest.skip("needs glibc's mallinfo2")
    engine.run_ops([CreateModelOp("held", "tinkerd/tiny-qwen3", LoraSpec(rank=8, alpha=8.0, seed=1))])
    data = sft_data(9, lengths=(256,) * 4)
    kept = _held(engine, "held", data, NEVER, monkeypatch)
    replayed = _held(engine, "held", data, 0, monkeypatch)
    config = engine.runtime("tinkerd/tiny-qwen3").model.config
    assert kept > 4 * replayed
    # The layers' inputs and the final hidden state, [1024, H] fp32 each, are what a replaying pass keeps.
    assert replayed < (config.num_hidden_layers + 4) * 1024 * config.hidden_size * 4


def _holds(rt, positions: int, kept: int) -> float:
    """What a decoder call over `positions` holds with `kept` of the tiny Qwen3's two layers keeping
    their activations: theirs, the others' inputs, and two layers' worth of working space."""
    config = rt.model.config
    layer = recompute.activation_bytes(config, torch.float32, positions) / 2
    return (2 + kept) * layer + (2 - kept) * positions * config.hidden_size * 4


def test_a_call_recomputes_the_fewest_layers_that_fit_the_share_of_free_memory(engine, monkeypatch):
    rt = engine.runtime("tinkerd/tiny-qwen3")
    assert rt.model.config.num_hidden_layers == 2
    free = [0]
    monkeypatch.setattr(recompute, "free_bytes", lambda device: free[0])
    monkeypatch.setattr(malloc, "give_back", lambda: False)
    for kept in (2, 1, 0):
        free[0] = int(_holds(rt, 100_000, kept) / recompute.FREE_SHARE) + 8
        assert rt.recompute.count(rt, 100_000) == 2 - kept
        assert rt.recompute.count(rt, 100_100) == min(2, 3 - kept)  # a little more: one more layer
    with torch.no_grad():  # a forward-only pass keeps nothing for a backward
        assert rt.recompute.count(rt, 10**9) == 0
    # A pass of several calls plans each for the calls after it too: the first of two equal calls
    # recomputes as if it held both.
    free[0] = int(_holds(rt, 100_000, 2) / recompute.FREE_SHARE) + 8
    with rt.recompute.whole_pass(200_000):
        assert rt.recompute.count(rt, 100_000) > 0
    assert rt.recompute.count(rt, 100_000) == 0
    # An explicit budget is the pass's: a later call has what the earlier ones left of it.
    rt.recompute.budget = int(_holds(rt, 100_000, 2)) + 8
    try:
        assert rt.recompute.count(rt, 100_000) == 0
        with rt.recompute.whole_pass(200_000):
            assert rt.recompute.count(rt, 100_000) > 0 and rt.recompute.count(rt, 100_000) > 0
    finally:
        rt.recompute.budget = None
    # Short of room on a CPU, the heap's free pages go back to the system first, and count.
    gave = []
    monkeypatch.setattr(malloc, "give_back", lambda: gave.append(1) or free.__setitem__(0, 10**15) or True)
    free[0] = 0
    assert rt.recompute.count(rt, 100_000) == 0 and gave == [1]
    # The head's logits past KEEP_CELLS are kept only where they fit the same way (SmolLM2's shape,
    # whose decoder holds far more than its logits: engine/head.py's BODY_SHARE).
    from transformers import LlamaConfig

    smol = SimpleNamespace(vocab_size=49152, recompute=recompute.Recompute(), precision=Precision(),
                           model=SimpleNamespace(config=LlamaConfig(vocab_size=49152, hidden_size=576,
                                                                    intermediate_size=1536, num_hidden_layers=30)))
    monkeypatch.setattr(malloc, "give_back", lambda: False)
    free[0] = 2 * 2**30
    rows = int(recompute.FREE_SHARE * free[0] // (4 * 49152))
    assert rows * 49152 > head.KEEP_CELLS
    assert head.keeps(smol, rows) and not head.keeps(smol, rows + 1)


def _measured_layer_bytes(models_dir, tmp_path, name: str, config, dtype: str) -> float:
    """Bytes a position's activations hold in the second decoder layer of a 2-layer model of these
    widths, rank-32 LoRA on every linear, 2 x 128 tokens: what the layer saves for its backward
    (torch's saved-tensor hooks, each storage once, not the base weights)."""
    from transformers import AutoModelForCausalLM

    path = tmp_path / name
    if not path.exists():
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(config).save_pretrained(path)
        for f in qwen3_tokenizer_dir().iterdir():
            shutil.copy(f, path)
    engine = Engine(models_dir, precision=Precision("cpu", dtype))
    rt = engine.load_base_model(str(path))
    engine.run_ops([CreateModelOp("m", str(path), LoraSpec(rank=32, alpha=32.0, seed=0))])
    weights = {t.untyped_storage().data_ptr() for t in [*rt.model.parameters(), *rt.model.buffers()]}
    saved: dict[int, int] = {}
    counting = []

    def pack(t):
        if counting and t.untyped_storage().data_ptr() not in weights:
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    layer = rt.model.get_decoder().layers[1]
    hooks = [layer.register_forward_pre_hook(lambda *_: counting.append(1)),
             layer.register_forward_hook(lambda *_: counting.clear())]
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            rng = np.random.default_rng(10)
            data = [sft_datum(rng.integers(0, 1000, 129)) for _ in range(2)]
            (fb,) = engine.run_ops([ForwardBackwardOp("m", data, "cross_entropy")])
    finally:
        for h in hooks:
            h.remove()
    assert not isinstance(fb, Exception), fb
    return sum(saved.values()) / 256


@pytest.mark.parametrize("name, dtype", [("smollm2", "float32"), ("smollm2", "bfloat16"), ("qwen3-0.6b", "float32"),
                                         ("qwen3-0.6b", "bfloat16"), ("qwen3-moe", "float32")])
def test_the_estimate_covers_what_a_layer_saves_at_real_widths(models_dir, tmp_path, name, dtype):
    """SmolLM2-135M's and Qwen3-0.6B's layer widths, and an MoE layer of Qwen3-30B-A3B's widths with
    fewer experts (its token copies scale with the experts a token goes to, not with how many
    there are); a 1,000-token vocabulary, which a layer's activations do not depend on."""
    from transformers import LlamaConfig, Qwen3Config, Qwen3MoeConfig

    common = dict(vocab_size=1000, num_hidden_layers=2, tie_word_embeddings=False)
    config = {
        "smollm2": LlamaConfig(hidden_size=576, intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3,
                               **common),
        "qwen3-0.6b": Qwen3Config(hidden_size=1024, intermediate_size=3072, num_attention_heads=16,
                                  num_key_value_heads=8, head_dim=128, **common),
        "qwen3-moe": Qwen3MoeConfig(hidden_size=2048, moe_intermediate_size=768, num_experts=8, num_experts_per_tok=8,
                                    num_attention_heads=32, num_key_value_heads=4, head_dim=128, **common),
    }[name]
    measured = _measured_layer_bytes(models_dir, tmp_path, name, config, dtype)
    estimate = recompute.activation_bytes(config, getattr(torch, dtype), 1) / 2
    assert measured <= estimate <= 1.35 * measured  # never short of what is held, nor far over it
