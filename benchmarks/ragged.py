"""Datums of mixed lengths: forward_backward in length buckets (engine/buckets.py) vs one padded batch.

In the engine, no HTTP: one adapter (rank 32) trains on a batch whose datum lengths are drawn
uniformly from [--min-tokens, --max-tokens] (an SFT batch of short and long conversations). The two
modes alternate (ABBA) on the same batch, so machine noise hits both alike; each prints its median
forward_backward time and real tokens per second, and bucketed / padded last. The losses of the two
modes are checked to agree within fp32 rounding on the way.

    python benchmarks/ragged.py                      # SmolLM2-135M, 1 thread, 16 datums of 32-512 tokens
    python benchmarks/ragged.py --threads 2 --datums 32 --max-tokens 1024
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from benchmarks.training import cpu_jiffies, load_average  # noqa: E402
from tinkerd.engine import buckets  # noqa: E402
from tinkerd.engine.engine import Engine  # noqa: E402
from tinkerd.engine.malloc import keep_freed_memory  # noqa: E402
from tinkerd.types import CreateModelOp, Datum, ForwardBackwardOp, LoraSpec, StepBatch  # noqa: E402

ON = buckets.MIN_PADDING


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="HuggingFaceTB/SmolLM2-135M-Instruct")
    ap.add_argument("--models-dir", default="/tmp/tinkerd-bench/models")
    ap.add_argument("--datums", type=int, default=16)
    ap.add_argument("--min-tokens", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=512)
    ap.add_argument("--rank", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    keep_freed_memory()
    engine = Engine(Path(args.models_dir))
    rt = engine.load_base_model(args.model)
    engine.run_ops([CreateModelOp("a", args.model, LoraSpec(rank=args.rank, alpha=32.0, seed=0))])
    rng = np.random.default_rng(0)
    lengths = rng.integers(args.min_tokens, args.max_tokens + 1, args.datums).tolist()
    data = []
    for n in lengths:
        seq = rng.integers(0, rt.vocab_size, n + 1)
        data.append(Datum(tokens=seq[:-1], loss_fn_inputs={"target_tokens": seq[1:], "weights": np.ones(n, np.float32)}))
    plan = buckets.plan(lengths)
    padded = len(lengths) * max(lengths)
    print(f"model={args.model} rank={args.rank} threads={args.threads} datums={len(lengths)} tokens={sum(lengths)} "
          f"(padded batch: {padded} positions; buckets: {len(plan or [[0]])} holding "
          f"{sum(lengths[g[0]] * len(g) for g in plan) if plan else padded})")

    def fb(mode: str) -> tuple[float, float]:
        buckets.MIN_PADDING = ON if mode == "bucketed" else 10**12
        t0 = time.perf_counter()
        (_, result), = engine.step(StepBatch(run=[("fb", ForwardBackwardOp("a", data, "cross_entropy"))])).done
        elapsed = time.perf_counter() - t0
        adapter = rt.pool.get("a")
        for t in adapter.parameters():
            t.grad = None
        adapter.pending_grads = 0
        return elapsed, result.metrics["loss:sum"]

    fb("bucketed"), fb("padded")  # warm-up
    times: dict[str, list[float]] = {"bucketed": [], "padded": []}
    load_before, (busy0, total0) = load_average(), cpu_jiffies()
    for r in range(args.rounds):
        losses = {}
        for mode in (("bucketed", "padded") if r % 2 == 0 else ("padded", "bucketed")):
            s, losses[mode] = fb(mode)
            times[mode].append(s)
        assert abs(losses["bucketed"] - losses["padded"]) <= 1e-5 * abs(losses["padded"]), losses
    busy1, total1 = cpu_jiffies()
    print(f"load average before: {load_before}, after: {load_average()}; machine busy "
          f"{100 * (busy1 - busy0) / max(1, total1 - total0):.0f}% of {len(times['padded']) * 2} passes")
    for mode, ts in times.items():
        med = statistics.median(ts)
        print(f"{mode:9s} median forward_backward {med * 1e3:8.1f} ms  {sum(lengths) / med:8.1f} tokens/s")
    print(f"bucketed / padded: {statistics.median(times['padded']) / statistics.median(times['bucketed']):.3f}")


if __name__ == "__main__":
    main()
