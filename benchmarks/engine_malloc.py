"""What glibc's malloc costs a training step, and what tinkerd/engine/malloc.py saves.

The engine alone, with no HTTP and no pipe, runs in a fresh spawned process the way the engine
process does (huge pages asked for). Each mode gets processes of its own, interleaved (A B C A B C):

- `default`: glibc as it comes;
- `mapped`: the engine's tuning before session 44 (freed blocks kept in the heap up to glibc's
  32 MB ceiling, so every bigger block mapped on allocation and unmapped on free);
- `tuned`: `keep_freed_memory()` as the engine runs it (no block mapped).

For each it prints the median over the rounds of wall and CPU time per step (one forward_backward
plus one optim_step), the minor page faults per step, and the process's peak RSS.

    python benchmarks/engine_malloc.py --rounds 3                        # tiny model, ragged small batches, 1 thread
    python benchmarks/engine_malloc.py --model HuggingFaceTB/SmolLM2-135M-Instruct --rows 8 --tokens 1024 \\
        --threads 2 --steps 2 --rounds 1 --modes mapped,tuned            # a wide batch: 50 MB MLP activations
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

TINY = "tinkerd/tiny-qwen3"
_GLIBC_DEFAULT_MMAP_MAX = 65536


def _child(mode: str, args: argparse.Namespace, models_dir: str, out) -> None:
    if mode != "default":
        from tinkerd.engine import malloc

        malloc.keep_freed_memory()
        if mode == "mapped":  # mapping back on, as before session 44
            malloc._libc().mallopt(malloc._M_MMAP_MAX, _GLIBC_DEFAULT_MMAP_MAX)
    import resource

    import numpy as np
    import torch

    from tinkerd.engine.engine import Engine
    from tinkerd.types import AdamParams, CreateModelOp, Datum, ForwardBackwardOp, LoraSpec, OptimStepOp

    torch.set_num_threads(args.threads)
    engine = Engine(Path(models_dir))
    vocab = engine.load_base_model(args.model).vocab_size
    engine.run_ops([CreateModelOp("m", args.model, LoraSpec(args.rank, 32.0, seed=1))])
    rng = np.random.default_rng(0)
    batches = []
    for _ in range(args.steps):
        lengths = [args.tokens] * args.rows if args.tokens else rng.integers(8, 40, args.rows)
        toks = [rng.integers(1, min(vocab, 5000), int(n) + 1) for n in lengths]
        batches.append([Datum(tokens=t[:-1], loss_fn_inputs={"target_tokens": t[1:]}) for t in toks])

    def run() -> None:
        for batch in batches:
            engine.run_ops([ForwardBackwardOp("m", batch, "cross_entropy")])
            engine.run_ops([OptimStepOp("m", AdamParams(1e-3))])

    run()  # warm-up: allocator and caches reach their steady state
    r0, c0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.process_time(), time.perf_counter()
    for _ in range(args.repeats):
        run()
    n = args.repeats * args.steps
    r1 = resource.getrusage(resource.RUSAGE_SELF)
    out.put(((time.perf_counter() - t0) / n, (time.process_time() - c0) / n, (r1.ru_minflt - r0.ru_minflt) / n,
             (r1.ru_stime - r0.ru_stime) / n, r1.ru_maxrss / 1e6))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=8, help="distinct batches a pass; each is run 1 + --repeats times")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--model", default=TINY)
    ap.add_argument("--models-dir", default=None, help="default: a fresh temp dir (the tiny model is built there)")
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=0, help="tokens a row; 0: 8-40 at random")
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--modes", default="default,tuned", help="comma-separated: default,mapped,tuned")
    args = ap.parse_args()
    if args.models_dir is None:
        args.models_dir = tempfile.mkdtemp(prefix="tinkerd-malloc-") if args.model == TINY else "/tmp/tinkerd-bench/models"
    from tinkerd.engine.malloc import children_use_huge_pages

    modes = args.modes.split(",")
    ctx = mp.get_context("spawn")
    results: dict[str, list[tuple[float, ...]]] = {m: [] for m in modes}
    with children_use_huge_pages():  # as the engine process is started
        for _ in range(args.rounds):
            for mode in modes:
                out = ctx.Queue()
                proc = ctx.Process(target=_child, args=(mode, args, args.models_dir, out))
                proc.start()
                results[mode].append(out.get())
                proc.join()
    shape = f"{args.rows} x {args.tokens or '8-40'} tokens"
    print(f"engine alone in a spawned process, {args.model}, {shape}, rank {args.rank}, {args.threads} thread(s), "
          f"{args.rounds} rounds interleaved, load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs")
    for mode, rows in results.items():
        wall, cpu, faults, sys_s, rss = (statistics.median(r[i] for r in rows) for i in range(5))
        print(f"  malloc {mode:7}: {wall * 1e3:8.1f} ms wall, {cpu * 1e3:8.1f} ms CPU ({sys_s * 1e3:7.1f} ms system), "
              f"{faults:7.0f} minor page faults per step, peak RSS {rss:5.2f} GB")


if __name__ == "__main__":
    main()
