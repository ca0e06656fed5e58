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

    python benchmarks/launches.py                                  # SmolLM2-135M, bf16, 1 x 32 per run, N = 1, 4
    python benchmarks/launches.py --dtype float32 --tenants 1 2 4 8 --tokens 256 --datums 2
"""

from __future__ import annotations

import argparse
import collections
import functools
import sys
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
    """Non-view ATen ops dispatched inside the block, by name."""

    def __init__(self):
        super().__init__()
        self.ops: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__.split(".")[0]
        if name not in VIEWS:
            self.ops[name] += 1
        return func(*args, **(kwargs or {}))

    @property
    def total(self) -> int:
        return sum(self.ops.values())


def counted(fn) -> OpCount:
    with OpCount() as count:
        fn()
    return count


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="HuggingFaceTB/SmolLM2-135M-Instruct")
    ap.add_argument("--models-dir", default="/tmp/tinkerd-bench/models")
    ap.add_argument("--tenants", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--datums", type=int, default=1)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--rank", type=int, default=32)
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16")
    ap.add_argument("--foreach", choices=["on", "off"], default="on",
                    help="on: the non-finite check and gradient bound as on CUDA (foreach norms); off: as on the CPU")
    ap.add_argument("--top", type=int, default=8, help="print the most frequent ops of the largest N")
    args = ap.parse_args()
    if args.foreach == "on":
        finite.first_non_finite = functools.partial(finite.first_non_finite, foreach=True)
        finite.magnitude = functools.partial(step_bounds.magnitude, foreach=True)
    torch.set_num_threads(1)
    engine = Engine(Path(args.models_dir), precision=Precision("cpu", args.dtype))
    rt = engine.load_base_model(args.model)
    print(f"model={args.model} dtype={args.dtype} rank={args.rank} batch/run={args.datums}x{args.tokens} "
          f"foreach={args.foreach}: non-view ATen ops (~ kernel launches on a GPU)")
    print(f"{'runs':>5} {'fb pass':>8} {'x solo':>7} {'optim':>7} {'round':>7} {'x solo':>7} {'per run':>8}")
    solo = None
    for n in args.tenants:
        ids = [f"n{n}-{k}" for k in range(n)]
        engine.run_ops([CreateModelOp(m, args.model, LoraSpec(rank=args.rank, alpha=32.0, seed=k)) for k, m in enumerate(ids)])
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
        solo = solo or (passes.total, total)
        print(f"{n:>5} {passes.total:>8} {passes.total / solo[0]:>7.2f} {steps.total:>7} {total:>7} "
              f"{total / solo[1]:>7.2f} {total / n:>8.0f}")
    print("most frequent in the last pass:", ", ".join(f"{k} {v}" for k, v in passes.ops.most_common(args.top)))


if __name__ == "__main__":
    main()
