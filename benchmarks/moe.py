"""MoE forward_backward tokens/s: tinkerd's experts LoRA (engine/lora/experts.py) vs HF + PEFT
`target_parameters`, on one tiny-but-not-trivial random Qwen3-MoE (8 experts, top-2), or with
`--family gpt_oss` a gpt-oss of the same size (alternating sliding-window 128 / full layers, sinks,
interleaved gate/up experts with biases; eager attention, as transformers runs it).

Both sides train the same LoRA shape (rank R on q/k/v/o and on every routed expert's gate_up_proj
and down_proj) on the same batch, fp32 on CPU. tinkerd runs its engine's forward_backward op (the
path a request takes, without HTTP); PEFT runs the model's forward with the same tokens, a summed
cross-entropy, and backward. PEFT adds the delta to the whole expert stack every forward; tinkerd
applies it to the tokens routed to each expert.

    python benchmarks/moe.py [--threads 1] [--steps 5] [--family qwen3_moe|gpt_oss]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402


def build(out: Path, args) -> None:
    from transformers import GptOssConfig, GptOssForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    if args.family == "gpt_oss":
        config = GptOssConfig(vocab_size=8192, hidden_size=256, intermediate_size=384, num_hidden_layers=4,
                              num_attention_heads=8, num_key_value_heads=4, head_dim=32, num_local_experts=8,
                              num_experts_per_tok=2, sliding_window=128, max_position_embeddings=4096,
                              tie_word_embeddings=False)
        torch.manual_seed(0)
        GptOssForCausalLM(config).save_pretrained(out)
        return
    config = Qwen3MoeConfig(vocab_size=8192, hidden_size=256, intermediate_size=512, moe_intermediate_size=384,
                            num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4, head_dim=32,
                            num_experts=8, num_experts_per_tok=2, max_position_embeddings=4096,
                            tie_word_embeddings=False)
    torch.manual_seed(0)
    Qwen3MoeForCausalLM(config).save_pretrained(out)


def interleaved(fns: list, steps: int) -> list[tuple[float, float]]:
    """Best (wall s, CPU s) of each fn over `steps` rounds run A B A B ..., after one warm-up each:
    on a loaded machine both see the same load, and CPU seconds do not count time spent descheduled."""
    for fn in fns:
        fn()
    runs: list[list[tuple[float, float]]] = [[] for _ in fns]
    for _ in range(steps):
        for i, fn in enumerate(fns):
            t, c = time.perf_counter(), time.process_time()
            fn()
            runs[i].append((time.perf_counter() - t, time.process_time() - c))
    return [(min(w for w, _ in r), min(c for _, c in r)) for r in runs]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--family", choices=("qwen3_moe", "gpt_oss"), default="qwen3_moe")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from tinkerd.engine.engine import Engine
    from tinkerd.types import CreateModelOp, Datum, ForwardBackwardOp, LoraSpec

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "moe"
        build(model_dir, args)
        rng = np.random.default_rng(0)
        seqs = [rng.integers(0, 8192, args.seq + 1) for _ in range(args.batch)]
        tokens = args.batch * args.seq

        engine = Engine(Path(tmp) / "models")
        engine.load_base_model(str(model_dir))
        spec = LoraSpec(rank=args.rank, alpha=float(args.rank), seed=1, train_unembed=False)
        (created,) = engine.run_ops([CreateModelOp("bench", str(model_dir), spec)])
        data = [Datum(tokens=s[:-1], loss_fn_inputs={"target_tokens": s[1:]}) for s in seqs]
        adapter = engine.runtime(str(model_dir)).pool.get("bench")

        def tinkerd_step():
            (r,) = engine.run_ops([ForwardBackwardOp("bench", data, "cross_entropy")])
            assert not isinstance(r, Exception), r
            for t in adapter.parameters():
                t.grad = None

        base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        peft_model = get_peft_model(base, LoraConfig(
            r=args.rank, lora_alpha=args.rank, lora_dropout=0.0, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
            target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]))
        ids = torch.tensor(np.stack([s[:-1] for s in seqs]))
        labels = torch.tensor(np.stack([s[1:] for s in seqs]))

        def peft_step():
            logits = peft_model(input_ids=ids).logits
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum")
            loss.backward()
            peft_model.zero_grad(set_to_none=True)

        (ours, ours_cpu), (theirs, theirs_cpu) = interleaved([tinkerd_step, peft_step], args.steps)
    print(f"{args.family} 4 layers, hidden 256, 8 experts top-2 (I=384), rank {args.rank}, "
          f"batch {args.batch} x {args.seq} tokens, threads {args.threads}, best of {args.steps} interleaved")
    print(f"tinkerd experts LoRA: {ours * 1e3:.0f} ms/step, {tokens / ours:.0f} tokens/s, {tokens / ours_cpu:.0f} tokens/CPU-s")
    print(f"HF + PEFT target_parameters: {theirs * 1e3:.0f} ms/step, {tokens / theirs:.0f} tokens/s, "
          f"{tokens / theirs_cpu:.0f} tokens/CPU-s")
    print(f"ratio tinkerd / PEFT throughput: {theirs / ours:.2f}x wall, {theirs_cpu / ours_cpu:.2f}x CPU")


if __name__ == "__main__":
    main()
