"""What glibc's malloc costs a training step, and what tinkerd/engine/malloc.py saves.

The engine alone, with no HTTP and no pipe, runs in a fresh spawned process the way the engine
process does. It runs fresh process by fresh process, with the malloc tuning off then on,
interleaved (A B A B), on the tiny model with 1 thread. For each it prints the median over the
rounds of wall and CPU time per step (one forward_backward of 4 datums plus one optim_step) and of
the minor page faults per step.

    python benchmarks/engine_malloc.py --rounds 3
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


def _child(tuned: bool, models_dir: str, steps: int, out) -> None:
    if tuned:
        from tinkerd.engine.malloc import keep_freed_memory

        keep_freed_memory()
    import resource

    import numpy as np
    import torch

    from tinkerd.engine.engine import Engine
    from tinkerd.types import AdamParams, CreateModelOp, Datum, ForwardBackwardOp, LoraSpec, OptimStepOp

    torch.set_num_threads(1)
    engine = Engine(Path(models_dir))
    engine.load_base_model(TINY)
    engine.run_ops([CreateModelOp("m", TINY, LoraSpec(8, 32.0, seed=1))])
    rng = np.random.default_rng(0)
    batches = []
    for _ in range(steps):
        toks = [rng.integers(1, 5000, int(rng.integers(8, 40))) for _ in range(4)]
        batches.append([Datum(tokens=t[:-1], loss_fn_inputs={"target_tokens": t[1:]}) for t in toks])

    def run() -> None:
        for batch in batches:
            engine.run_ops([ForwardBackwardOp("m", batch, "cross_entropy")])
            engine.run_ops([OptimStepOp("m", AdamParams(1e-3))])

    run()  # warm-up: allocator and caches reach their steady state
    r0, c0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.process_time(), time.perf_counter()
    run()
    run()
    n = 2 * steps
    faults = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - r0.ru_minflt) / n
    out.put(((time.perf_counter() - t0) / n, (time.process_time() - c0) / n, faults))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=8)
    args = ap.parse_args()
    models_dir = tempfile.mkdtemp(prefix="tinkerd-malloc-")
    ctx = mp.get_context("spawn")
    results: dict[bool, list[tuple[float, float, float]]] = {False: [], True: []}
    for _ in range(args.rounds):
        for tuned in (False, True):
            out = ctx.Queue()
            proc = ctx.Process(target=_child, args=(tuned, models_dir, args.steps, out))
            proc.start()
            results[tuned].append(out.get())
            proc.join()
    print(f"engine alone in a spawned process, tiny model, 1 thread, {args.rounds} rounds interleaved, "
          f"load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs")
    for tuned, rows in results.items():
        wall, cpu, faults = (statistics.median(r[i] for r in rows) for i in range(3))
        print(f"  malloc {'tuned  ' if tuned else 'default'}: {wall * 1e3:6.1f} ms wall, {cpu * 1e3:6.1f} ms CPU, "
              f"{faults:6.0f} minor page faults per step")


if __name__ == "__main__":
    main()
