"""bf16 vs fp32: the same SDK training loop on two tinkerd servers, one `--dtype bfloat16`.

Both servers serve the same model with the same LoRA (rank, layers, seed), batch, learning rate and
thread count; steps alternate fp32, bf16, fp32, bf16 ... so machine noise hits both alike. Prints
the two loss curves side by side, tokens/s of each, the CPU other processes used meanwhile, and the
bf16 / fp32 ratio last. The path is the whole one a user pays for: SDK -> HTTP -> control -> engine.

    python benchmarks/precision.py                          # SmolLM2-135M, 2 x 256 tokens, 1 thread
    python benchmarks/precision.py --threads 2 --rounds 4
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

from benchmarks.training import TinkerdSDK, cpu_jiffies, make_batch, proc_jiffies, tree_jiffies  # noqa: E402
from tests.serverproc import start_server  # noqa: E402

DTYPES = ("float32", "bfloat16")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="HuggingFaceTB/SmolLM2-135M-Instruct")
    ap.add_argument("--data-dir", default="/tmp/tinkerd-bench-precision", help="reused, so the model is converted once")
    ap.add_argument("--rows", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--rank", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=4, help="fp32/bf16 rounds; each side runs --steps steps per round")
    ap.add_argument("--steps", type=int, default=2)
    args = ap.parse_args()
    os.environ.setdefault("TINKER_TELEMETRY", "0")

    print("uptime at start:", subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip())
    servers = {}
    try:
        for dtype in DTYPES:  # one after the other: the second reuses the first's converted model
            servers[dtype] = start_server(Path(args.data_dir) / dtype, [args.model],
                                          ["--threads", str(args.threads), "--dtype", dtype])
        from transformers import AutoConfig

        from tinkerd.engine.model.registry import cache_dir_for

        model_dir = cache_dir_for(args.model, Path(args.data_dir) / DTYPES[0] / "models")
        vocab = AutoConfig.from_pretrained(str(model_dir) if model_dir.exists() else args.model).vocab_size
        batch = make_batch(vocab, args.rows, args.tokens)
        sides = {dtype: TinkerdSDK(srv.url, args.model, args.rank, batch) for dtype, srv in servers.items()}
        losses = {dtype: [side.step()] for dtype, side in sides.items()}  # warm-up, and step 1 of the curves
        times: dict[str, list[float]] = {k: [] for k in sides}
        busy0, total0 = cpu_jiffies()
        own0 = proc_jiffies(os.getpid()) + sum(tree_jiffies(s.proc.pid) for s in servers.values())
        for _ in range(args.rounds):
            for dtype, side in sides.items():
                for _ in range(args.steps):
                    t0 = time.perf_counter()
                    losses[dtype].append(side.step())
                    times[dtype].append(time.perf_counter() - t0)
        busy1, total1 = cpu_jiffies()
        own1 = proc_jiffies(os.getpid()) + sum(tree_jiffies(s.proc.pid) for s in servers.values())
    finally:
        for srv in servers.values():
            srv.stop()

    tokens = args.rows * args.tokens
    hz = os.sysconf("SC_CLK_TCK")
    wall_s = (total1 - total0) / os.cpu_count() / hz
    print(f"model={args.model} batch={args.rows}x{args.tokens} rank={args.rank} threads={args.threads} "
          f"steps/side={args.rounds * args.steps} (+1 warm-up) lr=1e-4 cpus={os.cpu_count()}")
    print(f"CPU used by other processes during the run: {max(0, (busy1 - busy0) - (own1 - own0)) / hz:.1f} s "
          f"over {wall_s:.1f} s wall")
    print("uptime at end:", subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip())
    print(f"{'step':>4}  {'loss fp32':>12}  {'loss bf16':>12}  {'bf16 - fp32':>12}")
    for i, (a, b) in enumerate(zip(losses["float32"], losses["bfloat16"])):
        print(f"{i + 1:>4}  {a:12.3f}  {b:12.3f}  {b - a:+12.3f}")
    rates = {}
    for dtype, ts in times.items():
        med = float(np.median(ts))
        rates[dtype] = tokens / med
        print(f"{dtype:9s} median step {med * 1e3:8.1f} ms   {rates[dtype]:8.1f} tokens/s")
    print(f"ratio bf16 / fp32 tokens/s: {rates['bfloat16'] / rates['float32']:.3f}")


if __name__ == "__main__":
    main()
