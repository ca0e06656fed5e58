"""forward_backward tokens/s of the MoE and hybrid families: tinkerd's engine vs HF + PEFT.

One tiny-but-not-trivial random model per family, built here from a config and a seed (vocab 8192,
hidden 256, 4 layers, fp32):

- `qwen3_moe`: Qwen3-MoE, 8 experts top-2 (moe_intermediate 384);
- `qwen3_5`: Qwen3.5 dense hybrid, layers 0-2 Gated DeltaNet and layer 3 gated full attention
  (transformers' PyTorch fallback kernels on both sides);
- `qwen3_5_moe`: the same hybrid layers with 8 experts top-2 and a gated shared expert;
- `gpt_oss`: gpt-oss, 8 experts top-2 (interleaved gate/up with biases, a clamped SwiGLU), layers
  alternating sliding-window (128) and full attention with sinks (eager attention, as transformers
  runs it).

Both sides train the same LoRA (rank R on every module tinkerd's adapter has, read from the adapter
itself: q/k/v/o, the DeltaNet in_proj_qkv/in_proj_z/out_proj, the dense or shared MLP's
gate/up/down_proj, and each routed expert's gate_up_proj and down_proj) on the same batch. tinkerd runs its
engine's forward_backward op (the path a request takes, without HTTP; its experts LoRA applies each
delta to the tokens routed to each expert). PEFT gets `target_modules` for the linears and
`target_parameters` for the experts (it adds the delta to the whole expert stack every forward) and
runs the model's forward, a summed cross-entropy and backward, with transformers' default experts
implementation.

Fair ground, as benchmarks/training.py gives its baseline: one process, the same torch thread count,
glibc malloc tuned as the engine process is (engine/malloc.py: freed memory kept, huge pages asked
for; the script re-execs itself with the tunable). Steps are interleaved A B A B after a warm-up of
each, and each step's wall time and CPU time (time.process_time: this process, both sides run in
it) are kept; the medians give tokens/s and tokens per CPU-second. On a loaded machine the CPU
figure is the one to compare.

    python benchmarks/moe.py [--families qwen3_moe,qwen3_5,qwen3_5_moe,gpt_oss] [--threads 1] [--rounds 3]

Measured: docs/testing.md (benchmarks table).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from tinkerd.engine.malloc import keep_freed_memory, with_huge_pages  # noqa: E402
from tinkerd.engine.model.registry import own_memory  # noqa: E402

VOCAB = 8192
EXPERT_PARAMS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
HYBRID = dict(linear_conv_kernel_dim=4, linear_key_head_dim=32, linear_value_head_dim=32, linear_num_key_heads=4,
              linear_num_value_heads=8, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                         "partial_rotary_factor": 0.25})


def build(family: str, out: Path) -> str:
    """Build `family` into `out`; returns a one-line description."""
    from transformers import (GptOssConfig, GptOssForCausalLM, Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig, Qwen3_5TextConfig,
                              Qwen3MoeConfig, Qwen3MoeForCausalLM)

    common = dict(vocab_size=VOCAB, hidden_size=256, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
                  head_dim=32, max_position_embeddings=4096, tie_word_embeddings=False)
    moe = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=384)
    if family == "qwen3_moe":
        config, cls = Qwen3MoeConfig(**common, **moe, intermediate_size=512), Qwen3MoeForCausalLM
        what = "Qwen3-MoE, 8 experts top-2 (I=384)"
    elif family == "qwen3_5":
        config, cls = Qwen3_5TextConfig(**common, **HYBRID, intermediate_size=768), Qwen3_5ForCausalLM
        what = "Qwen3.5 hybrid (3 DeltaNet + 1 attention), MLP 768"
    elif family == "qwen3_5_moe":
        config = Qwen3_5MoeTextConfig(**common, **HYBRID, **moe, shared_expert_intermediate_size=512)
        cls, what = Qwen3_5MoeForCausalLM, "Qwen3.5-MoE hybrid, 8 experts top-2 (I=384) + shared expert 512"
    elif family == "gpt_oss":  # alternating sliding-window 128 / full layers, sinks, interleaved gate/up with biases
        config = GptOssConfig(**common, intermediate_size=384, num_local_experts=8, num_experts_per_tok=2,
                              sliding_window=128)
        cls, what = GptOssForCausalLM, "gpt-oss, 8 experts top-2 (I=384), sliding window 128 (eager attention)"
    else:
        raise SystemExit(f"unknown family {family!r}")
    torch.manual_seed(0)
    cls(config).save_pretrained(out)
    return what


def interleaved(sides: dict, rounds: int) -> dict[str, tuple[list[float], list[float]]]:
    """Each side once to warm up, then A B A B ...: (wall seconds, CPU seconds) per step per side."""
    for fn in sides.values():
        fn()
    out = {name: ([], []) for name in sides}
    for _ in range(rounds):
        for name, fn in sides.items():
            t, c = time.perf_counter(), time.process_time()
            fn()
            out[name][0].append(time.perf_counter() - t)
            out[name][1].append(time.process_time() - c)
    return out


def bench_family(family: str, args, tmp: Path) -> None:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from tinkerd.engine.engine import Engine
    from tinkerd.types import CreateModelOp, Datum, ForwardBackwardOp, LoraSpec

    model_dir = tmp / family
    what = build(family, model_dir)
    rng = np.random.default_rng(0)
    seqs = [rng.integers(0, VOCAB, args.seq + 1) for _ in range(args.batch)]
    tokens = args.batch * args.seq

    engine = Engine(tmp / "models")
    engine.load_base_model(str(model_dir))
    spec = LoraSpec(rank=args.rank, alpha=float(args.rank), seed=1, train_unembed=False)
    engine.run_ops([CreateModelOp(family, str(model_dir), spec)])
    data = [Datum(tokens=s[:-1], loss_fn_inputs={"target_tokens": s[1:]}) for s in seqs]
    adapter = engine.runtime(str(model_dir)).pool.get(family)

    def tinkerd_step():
        (r,) = engine.run_ops([ForwardBackwardOp(family, data, "cross_entropy")])
        assert not isinstance(r, Exception), r
        for t in adapter.parameters():
            t.grad = None

    # The same LoRA as tinkerd's adapter: its module names, and the experts' stacks where it has them.
    linears = sorted({n.rsplit(".", 1)[-1] for n in adapter.weights if ".experts." not in n})
    experts = EXPERT_PARAMS if any(".experts." in n for n in adapter.weights) else None
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    own_memory(base)  # as the engine's (engine/model/registry.py)
    peft_model = get_peft_model(base, LoraConfig(r=args.rank, lora_alpha=args.rank, lora_dropout=0.0,
                                                 target_modules=linears, target_parameters=experts))
    ids = torch.tensor(np.stack([s[:-1] for s in seqs]))
    labels = torch.tensor(np.stack([s[1:] for s in seqs]))

    def peft_step():
        logits = peft_model(input_ids=ids).logits
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum")
        loss.backward()
        peft_model.zero_grad(set_to_none=True)

    runs = interleaved({"tinkerd": tinkerd_step, "HF + PEFT": peft_step}, args.rounds)
    print(f"\n{family}: {what}; 4 layers, hidden 256, vocab {VOCAB}, rank {args.rank} on {linears}"
          f"{' + experts ' + str(experts) if experts else ''}; batch {args.batch} x {args.seq} tokens, "
          f"threads {args.threads}, {args.rounds} interleaved steps per side (medians)")
    rates = {}
    for name, (wall, cpu) in runs.items():
        w, c = float(np.median(wall)), float(np.median(cpu))
        rates[name] = (tokens / w, tokens / c)
        print(f"  {name:10s} {w * 1e3:7.0f} ms/step  {tokens / w:7.0f} tokens/s   {c * 1e3:7.0f} CPU-ms/step  "
              f"{tokens / c:7.0f} tokens/CPU-s")
    (tw, tc), (pw, pc) = rates["tinkerd"], rates["HF + PEFT"]
    print(f"  ratio tinkerd / PEFT: {tw / pw:.2f}x (wall), {tc / pc:.2f}x (CPU)")
    if args.profile:
        from torch.profiler import ProfilerActivity, profile
        for name, fn in (("tinkerd", tinkerd_step), ("HF + PEFT", peft_step)):
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                fn()
            print(f"  profile, {name}:\n" + prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.profile))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--families", default="qwen3_moe,qwen3_5,qwen3_5_moe")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=3, help="interleaved steps per side, after one warm-up each")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--profile", type=int, default=0, help="print this many top ops of one profiled step per side")
    args = ap.parse_args()
    if "glibc.malloc.hugetlb" not in os.environ.get("GLIBC_TUNABLES", ""):
        # Read at process start: re-exec with it, as the engine process is started.
        os.execve(sys.executable, [sys.executable, *sys.argv], with_huge_pages(os.environ))
    # Both sides run in this process, with the engine process's malloc tuning: HF's [tokens,
    # vocabulary] logits (33.5 MB at 4 x 256) were otherwise mapped and faulted in anew every step.
    keep_freed_memory()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        for family in args.families.split(","):
            bench_family(family, args, Path(tmp))


if __name__ == "__main__":
    main()
