"""Host work of a training round, counted: ATen ops per forward_backward pass and optim_step of N runs.

On a GPU the engine is bound by its kernel launches, not by the GPU (docs/architecture.md §8: an
H200 was busy 18 ms of a ~210 ms SmolLM2 forward_backward), so a shared pass of N runs costs what
its launches cost, and issue 20's latency target (4 tenants, each step <= 1.5x its solo latency)
asks for a 4-run round of at most ~1.5x a solo round's launches. This counts them on any machine:
every non-view ATen op the engine dispatches (a view launches nothing; most other ops launch one
kernel, a few launch several), in the engine, no HTTP, with the same ops a CUDA engine runs
(`--foreach on`, the default: the non-finite check and the gradient bound take foreach norms as on
CUDA; `off`: per-tensor reductions, as on the CPU). Counts, not times: they do not depend on the
machine's load.

With `--time K` it also times each round (median of K, in the engine, after a synchronize on CUDA):
on a GPU that is issue 20's latency case without HTTP, the 4-run round against the solo one. With
`--profile` on CUDA, torch.profiler counts the kernels a pass launches and the time the GPU was
busy in it against its wall time.

    python benchmarks/launches.py                                  # SmolLM2-135M, bf16, 1 x 32 per run, N = 1, 4
    python benchmarks/launches.py --dtype float32 --tenants 1 2 4 8 --tokens 256 --datums 2
    python benchmarks/launches.py --device cuda --shape .gpu/smollm2-135m --time 5 --profile   # on a lent GPU
"""

from __future__ import annotations

import argparse
import atexit
import collections
import functools
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from benchmarks.shared_pass import batch  # noqa: E402
from tinkerd.engine import finite, step_bounds  # noqa: E402
from tinkerd.engine.engine import Engine  # noqa: E402
from tinkerd.engine.precision import Precision  # noqa: E402
from tinkerd.types import AdamParams, CreateModelOp, ForwardBackwardOp, LoraSpec, OptimStepOp, StepBatch  # noqa: E402

VIEWS = {"view", "as_strided", "t", "transpose", "reshape", "_unsafe_view", "expand", "slice", "select",
         "unsqueeze", "squeeze", "permute", "detach", "alias", "split", "split_with_sizes", "unbind", "narrow",
         "_reshape_alias", "lift_fresh"}


class OpCount(TorchDispatchMode):
    """Non-view ATen ops dispatched inside the block, by name (`views`: the views too)."""

    def __init__(self, views: bool = False):
        super().__init__()
        self.ops: collections.Counter = collections.Counter()
        self.views = views

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__.split(".")[0]
        if self.views or name not in VIEWS:
            self.ops[name] += 1
        return func(*args, **(kwargs or {}))

    @property
    def total(self) -> int:
        return sum(self.ops.values())


def counted(fn) -> OpCount:
    with OpCount() as count:
        fn()
    return count


def timed_ms(fn, times: int, device: str) -> float:
    """Median wall ms of `times` calls of fn, each ended by a synchronize on CUDA."""
    runs = []
    for _ in range(times):
        t = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        runs.append(1e3 * (time.perf_counter() - t))
    return statistics.median(runs)


def kernels(fn) -> str:
    """CUDA kernels one call of fn launches, and the GPU's busy ms against the call's wall ms."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    t = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    wall = 1e3 * (time.perf_counter() - t)
    device_events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    busy = sum(e.time_range.elapsed_us() for e in device_events) / 1e3  # overlapping kernels count twice
    return f"{len(device_events)} kernels, GPU busy {busy:.1f} ms of {wall:.1f} ms wall (under the profiler)"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="HuggingFaceTB/SmolLM2-135M-Instruct")
    ap.add_argument("--shape", default=None, help="a folder with a config and tokenizer: random weights of it (gpu_check.py)")
    ap.add_argument("--models-dir", default="/tmp/tinkerd-bench/models")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--tenants", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--datums", type=int, default=1)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--rank", type=int, default=32)
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16")
    ap.add_argument("--foreach", choices=["on", "off"], default="on",
                    help="on: the non-finite check and gradient bound as on CUDA (foreach norms); off: as on the CPU")
    ap.add_argument("--time", type=int, default=0, help="also time each round: median of this many")
    ap.add_argument("--profile", action="store_true", help="CUDA: kernels and GPU busy time of each pass")
    ap.add_argument("--top", type=int, default=8, help="print the most frequent ops of the largest N")
    args = ap.parse_args()
    if args.foreach == "on":
        finite.first_non_finite = functools.partial(finite.first_non_finite, foreach=True)
        finite.magnitude = functools.partial(step_bounds.magnitude, foreach=True)
    elif args.device == "cuda":
        finite.first_non_finite = functools.partial(finite.first_non_finite, foreach=False)
        finite.magnitude = functools.partial(step_bounds.magnitude, foreach=False)
    torch.set_num_threads(1)
    model = args.model
    if args.shape:
        from benchmarks.gpu_check import random_weights

        scratch = tempfile.mkdtemp(prefix="launches-")
        atexit.register(shutil.rmtree, scratch, ignore_errors=True)
        model = random_weights(args.shape, Path(scratch) / "random-weights", args.dtype)
    engine = Engine(Path(args.models_dir), precision=Precision(args.device, args.dtype))
    rt = engine.load_base_model(model)
    print(f"model={model} device={args.device} dtype={args.dtype} rank={args.rank} batch/run={args.datums}x{args.tokens} "
          f"foreach={args.foreach}: non-view ATen ops (~ kernel launches on a GPU)"
          + (f"; engine ms, median of {args.time}" if args.time else ""))
    print(f"{'runs':>5} {'fb pass':>8} {'x solo':>7} {'optim':>7} {'round':>7} {'x solo':>7} {'per run':>8}"
          + (f" {'fb ms':>8} {'optim ms':>9} {'round ms':>9} {'x solo':>7}" if args.time else ""))
    solo = None
    for n in args.tenants:
        ids = [f"n{n}-{k}" for k in range(n)]
        engine.run_ops([CreateModelOp(m, model, LoraSpec(rank=args.rank, alpha=32.0, seed=k)) for k, m in enumerate(ids)])
        data = [batch(k, args.datums, args.tokens, rt.vocab_size) for k in range(n)]

        def fb():
            out = engine.step(StepBatch(run=[(f"fb{k}", ForwardBackwardOp(m, data[k], "cross_entropy"))
                                             for k, m in enumerate(ids)]))
            assert n == 1 or out.shared_passes == [n], out.shared_passes

        def optim():
            engine.step(StepBatch(run=[(f"o{k}", OptimStepOp(m, AdamParams(learning_rate=1e-4))) for k, m in enumerate(ids)]))

        fb()
        optim()  # warm-up: the first step measures its bounds (engine/step_bounds.py)
        passes, steps = counted(fb), counted(optim)
        total = passes.total + steps.total
        line = (f"{n:>5} {passes.total:>8} {passes.total / (solo or {}).get('fb', passes.total):>7.2f} {steps.total:>7} "
                f"{total:>7} {total / (solo or {}).get('round', total):>7.2f} {total / n:>8.0f}")
        if args.time:
            fb_ms, opt_ms = [], []
            for _ in range(args.time):
                fb_ms.append(timed_ms(fb, 1, args.device))
                opt_ms.append(timed_ms(optim, 1, args.device))
            f, o = statistics.median(fb_ms), statistics.median(opt_ms)
            round_ms = statistics.median(a + b for a, b in zip(fb_ms, opt_ms))
            line += f" {f:>8.1f} {o:>9.1f} {round_ms:>9.1f} {round_ms / (solo or {}).get('ms', round_ms):>7.2f}"
        else:
            round_ms = 0.0
        solo = solo or {"fb": passes.total, "round": total, "ms": round_ms}
        print(line, flush=True)
        if args.profile and args.device == "cuda":
            try:
                print(f"      pass of {n}: {kernels(fb)}", flush=True)
                optim()
            except Exception as e:  # noqa: BLE001  a profiler that fails costs its line, not the counts
                print(f"      pass of {n}: the profiler failed: {type(e).__name__}: {e}", flush=True)
    print("most frequent in the last pass:", ", ".join(f"{k} {v}" for k, v in passes.ops.most_common(args.top)))


if __name__ == "__main__":
    main()
