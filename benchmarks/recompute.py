"""What recomputing activations (engine/recompute.py) costs a training step in time, and saves in memory.

The engine alone, no HTTP, in a fresh spawned process per mode and round, interleaved (A B C A B C),
tuned as the engine process is (engine/malloc.py). A mode is the activation budget of
`--activation-memory-gb`: `keep` (no pass reaches it: every activation kept), or a number of GiB (0:
every layer of every call replays its forward in the backward). Each step is one forward_backward and
one optim_step, the first not counted. For each mode: the median forward_backward, its ratio to
`keep`'s, the layers replayed per step, and the process's peak RSS and peak bytes in use by malloc
(glibc's mallinfo2, sampled every 5 ms: RSS also holds what the heap keeps after a free).

    python benchmarks/recompute.py --threads 2                     # SmolLM2, the cookbook's RL batch
    python benchmarks/recompute.py --rows 2 --tokens 256 --modes keep,0
"""

from __future__ import annotations

import argparse
import ctypes
import multiprocessing as mp
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"


class _MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in
                "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]


def _batch(args, vocab: int):
    import numpy as np

    from tinkerd.types import Datum

    rng = np.random.default_rng(0)
    top = min(vocab, 40000)
    if args.rows:  # plain rows of cross-entropy
        seqs = [rng.integers(100, top, args.tokens + 1) for _ in range(args.rows)]
        return [Datum(tokens=s[:-1], loss_fn_inputs={"target_tokens": s[1:]}) for s in seqs], "cross_entropy"
    data = []
    for _ in range(args.prompts):  # GRPO groups: samples of one prompt, importance_sampling
        prompt = rng.integers(100, top, args.prompt_tokens)
        for _ in range(args.samples):
            seq = np.concatenate([prompt, rng.integers(100, top, args.completion + 1)])
            n = len(seq) - 1
            advantages = np.zeros(n, np.float32)
            advantages[args.prompt_tokens - 1 :] = rng.normal()
            data.append(Datum(tokens=seq[:-1], loss_fn_inputs={
                "target_tokens": seq[1:], "advantages": advantages, "logprobs": rng.normal(-2, 0.5, n).astype(np.float32)}))
    return data, "importance_sampling"


def _child(mode: str, args: argparse.Namespace, out) -> None:
    from tinkerd.engine import malloc

    malloc.keep_freed_memory()
    import resource

    import torch

    from tinkerd.engine.engine import Engine
    from tinkerd.types import AdamParams, CreateModelOp, ForwardBackwardOp, LoraSpec, OptimStepOp

    torch.set_num_threads(args.threads)
    budget = 10**18 if mode == "keep" else int(float(mode) * 2**30)
    engine = Engine(Path(args.models_dir), activation_memory_bytes=budget)
    rt = engine.load_base_model(args.model)
    engine.run_ops([CreateModelOp("m", args.model, LoraSpec(args.rank, 32.0, seed=1))])
    data, loss = _batch(args, rt.vocab_size)
    libc = malloc._libc()
    libc.mallinfo2.restype = _MallInfo2
    peak, done = [0], threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], libc.mallinfo2().uordblks)
            time.sleep(0.005)

    threading.Thread(target=sample, daemon=True).start()
    times, replayed = [], 0
    for step in range(args.steps + 1):
        before = rt.recompute.replayed
        t0 = time.perf_counter()
        (result,) = engine.run_ops([ForwardBackwardOp("m", data, loss)])
        spent = time.perf_counter() - t0
        assert not isinstance(result, Exception), result
        engine.run_ops([OptimStepOp("m", AdamParams(learning_rate=1e-4))])
        if step:
            times.append(spent)
            replayed = rt.recompute.replayed - before
    done.set()
    out.put((statistics.median(times), replayed, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, peak[0]))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=MODEL)
    p.add_argument("--models-dir", default="/tmp/tinkerd-bench/models")
    p.add_argument("--modes", default="keep,3,2,0", help="keep, or activation budgets in GiB")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rank", type=int, default=32)
    p.add_argument("--rows", type=int, default=0, help="plain rows of --tokens each (default: GRPO groups)")
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--prompt-tokens", type=int, default=256)
    p.add_argument("--completion", type=int, default=64)
    p.add_argument("--steps", type=int, default=2, help="counted steps per process (one more runs first)")
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args()
    modes = args.modes.split(",")
    ctx = mp.get_context("spawn")
    got: dict[str, list] = {m: [] for m in modes}
    for r in range(args.rounds):
        for mode in modes if r % 2 == 0 else modes[::-1]:
            q = ctx.Queue()
            proc = ctx.Process(target=_child, args=(mode, args, q))
            proc.start()
            got[mode].append(q.get())
            proc.join()
    keep = statistics.median(x[0] for x in got[modes[0]])
    print(f"{'mode':>6} {'forward_backward':>17} {'ratio':>6} {'layers replayed':>16} {'peak RSS':>9} {'peak in use':>12}")
    for mode in modes:
        t = statistics.median(x[0] for x in got[mode])
        print(f"{mode:>6} {t * 1e3:>14.0f} ms {t / keep:>6.3f} {got[mode][-1][1]:>16} "
              f"{max(x[2] for x in got[mode]) / 2**30:>6.2f} GiB {max(x[3] for x in got[mode]) / 2**30:>8.2f} GiB")


if __name__ == "__main__":
    main()
