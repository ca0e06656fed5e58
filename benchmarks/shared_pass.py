"""Training across tenants: N runs' forward_backward ops in one pass (engine/cotrain.py) vs one op per pass.

In the engine, no HTTP: each of N adapters (rank 32) trains on its own batch (2 x 256 tokens by
default, issue 20's case); a round is one forward_backward and one optim_step per adapter. "shared"
hands the N forward_backward ops to Engine.step in one StepBatch, as the scheduler does under
--train-batch-tokens; "apart" hands them one per step, as with --train-batch-tokens 0. Modes and
tenant counts are interleaved round by round (ABBA), so machine noise hits both alike. Prints the
aggregate tokens/s of each and shared / apart last, and checks on the way that both modes give
the same losses (twin adapters: same rank and seed).

    python benchmarks/shared_pass.py                        # SmolLM2-135M, 1 thread, N = 1, 2, 4
    python benchmarks/shared_pass.py --threads 2 --rounds 3 --tenants 1 2 4 8
    python benchmarks/shared_pass.py --dtype bfloat16       # the bf16 engine
    python benchmarks/shared_pass.py --toy qwen3_moe --datums 1 --tokens 8 --threads 2 --rounds 5 --tenants 1 4
    python benchmarks/shared_pass.py --merged --datums 1 --tokens 8 --threads 2 --rounds 8 --tenants 1 4

`--merged` also times one adapter trained on all N runs' datums in one op (a "merged" run: the
shared pass's base-model work with one adapter's), to split a shared round into what the base model
costs and what each adapter adds. A closed-loop client of N sharing a pass waits a whole round, so
the latency ratio N tenants / 1 tenant cannot drop below merged round / solo round however cheap
the adapters are; and since an adapter's AdamW update is memory-bound (it reads and writes weights,
gradients and both moments: ~320 MB a step for SmolLM2's rank-32 adapter with its head LoRA), a
floor that keeps the adapters' own optim_steps is merged round + (N - 1) optim_steps of the shared
round. Measured on this 2-core CPU: docs/architecture.md section 9.

`--toy FAMILY` runs a random toy model of that family instead (benchmarks/moe.py's `build`: 4 layers,
hidden 256, vocab 8192, 8 experts top-2): qwen3_moe, qwen3_5 (hybrid) or gpt_oss, the families
whose shared passes have their own per-run layers (engine/grouped.py, lora/experts.py). Measured
(51720ae, 2 threads, 5 rounds, load 1.7-2.6, forward_backward of 4 runs shared / apart): 1 x 8
tokens per run Qwen3-MoE 1.42x, Qwen3.5 1.32x, gpt-oss 1.35x; 1 x 64 1.29x, 1.33x, 1.13x.
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

from tinkerd.engine.engine import Engine  # noqa: E402
from tinkerd.engine.malloc import keep_freed_memory  # noqa: E402
from tinkerd.engine.precision import Precision  # noqa: E402
from tinkerd.types import AdamParams, CreateModelOp, Datum, ForwardBackwardOp, LoraSpec, OptimStepOp, StepBatch  # noqa: E402


def batch(seed: int, datums: int, tokens: int, vocab: int) -> list[Datum]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(datums):
        seq = rng.integers(0, vocab, tokens + 1)
        out.append(Datum(tokens=seq[:-1], loss_fn_inputs={"target_tokens": seq[1:],
                                                         "weights": np.ones(tokens, np.float32)}))
    return out


def unshared(engine: Engine, ids: list[str], passes: list[int]) -> str:
    """Why N runs' ops did not go through one pass: the engine's row probe (engine/rowbits.py) found
    row counts of this model's GEMMs that round a row another way in a bigger batch, at this dtype
    and thread count, so the engine keeps each op's bits by running it alone; the benchmark has no
    shared pass to time then."""
    rt = engine.runtime_of(ids[0])
    odd = rt.odd_rows
    why = ("the probe turned shared passes off for this model (the engine's log line above names the GEMM)"
           if odd is None else f"passes avoid GEMMs of {sorted(odd)} rows")
    return (f"{len(ids)} runs did not share one pass (passes: {passes}): {why}, {rt.precision.dtype} at "
            f"{torch.get_num_threads()} threads on this machine's CPU (engine/rowbits.py). Try another "
            f"--tokens, --threads or --dtype.")


def round_s(engine: Engine, ids: list[str], data: list[list[Datum]], shared: bool) -> tuple[float, float, list[float]]:
    """Seconds for the forward_backward ops of every run, for them and an optim_step of every run,
    and the losses."""
    fbs = [(f"fb{k}", ForwardBackwardOp(m, data[k], "cross_entropy")) for k, m in enumerate(ids)]
    t0 = time.perf_counter()
    if shared:
        out = engine.step(StepBatch(run=fbs))
        if len(ids) > 1 and out.shared_passes != [len(ids)]:
            raise SystemExit(unshared(engine, ids, out.shared_passes))
        done = dict(out.done)
    else:
        done = {}
        for fb in fbs:
            done.update(engine.step(StepBatch(run=[fb])).done)
    fb_s = time.perf_counter() - t0
    engine.step(StepBatch(run=[(f"opt{k}", OptimStepOp(m, AdamParams(learning_rate=1e-4))) for k, m in enumerate(ids)]))
    elapsed = time.perf_counter() - t0
    return fb_s, elapsed, [done[f"fb{k}"].metrics["loss:sum"] for k in range(len(ids))]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="HuggingFaceTB/SmolLM2-135M-Instruct")
    ap.add_argument("--toy", choices=["qwen3_moe", "qwen3_5", "gpt_oss"], default=None,
                    help="a random toy model of this family (benchmarks/moe.py) instead of --model")
    ap.add_argument("--models-dir", default="/tmp/tinkerd-bench/models")
    ap.add_argument("--tenants", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--datums", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--rank", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                    help="bfloat16: the --dtype bfloat16 engine (bf16 base, fp32 master adapters)")
    ap.add_argument("--merged", action="store_true",
                    help="also time one adapter on all N runs' datums in one op: the latency floors (module docstring)")
    ap.add_argument("--per-run-loras", action="store_true",
                    help="turn engine/lora/batched.py off: every run's LoRA products as its own GEMMs")
    args = ap.parse_args()
    if args.per_run_loras:
        from tinkerd.engine.lora import batched

        batched.fits = lambda *a, **k: False
    keep_freed_memory()  # as the engine process does (engine/malloc.py): without it page faults inflate shared rounds ~1.8x
    torch.set_num_threads(args.threads)
    if args.toy:
        import atexit
        import shutil
        import tempfile

        from benchmarks.moe import build

        scratch = tempfile.mkdtemp(prefix="shared-pass-")
        atexit.register(shutil.rmtree, scratch, True)
        args.model = str(Path(scratch) / args.toy)
        print(build(args.toy, Path(args.model)))
    engine = Engine(Path(args.models_dir), precision=Precision("cpu", args.dtype))
    rt = engine.load_base_model(args.model)
    ids = {}
    for mode in ("shared", "apart"):
        for k in range(max(args.tenants)):
            model_id = f"{mode}-{k}"
            engine.run_ops([CreateModelOp(model_id, args.model, LoraSpec(rank=args.rank, alpha=32.0, seed=k))])
            ids.setdefault(mode, []).append(model_id)
    if args.merged:
        engine.run_ops([CreateModelOp("merged-0", args.model, LoraSpec(rank=args.rank, alpha=32.0, seed=0))])
        ids["merged"] = ["merged-0"]
    data = [batch(k, args.datums, args.tokens, rt.vocab_size) for k in range(max(args.tenants))]
    round_s(engine, ids["shared"][:2], data, True)  # warm-up: allocator, oneDNN primitives
    round_s(engine, ids["apart"][:2], data, False)
    times: dict[tuple[int, str], list[float]] = {}
    fb_times: dict[tuple[int, str], list[float]] = {}
    for r in range(args.rounds):
        for n in args.tenants:
            order = ("shared", "apart") if r % 2 == 0 else ("apart", "shared")
            if args.merged:
                order = (*order, "merged") if r % 2 == 0 else ("merged", *order)
            losses = {}
            for mode in order:
                if mode == "merged":  # one adapter, every run's datums: [sum(data[:n], [])]
                    fb_s, s, _ = round_s(engine, ids[mode], [sum(data[:n], [])], True)
                else:
                    fb_s, s, losses[mode] = round_s(engine, ids[mode][:n], data, mode == "shared")
                times.setdefault((n, mode), []).append(s)
                fb_times.setdefault((n, mode), []).append(fb_s)
            # Twins on the same data, in lock-step: shared equals apart to the bit (engine/cotrain.py).
            assert losses["shared"] == losses["apart"], losses
    print(f"model={args.model} dtype={args.dtype} per_run_loras={args.per_run_loras} rank={args.rank} threads={args.threads} batch/tenant={args.datums}x{args.tokens} "
          f"rounds={args.rounds} (medians; aggregate tokens/s)")
    per_round = args.datums * args.tokens
    for label, table in (("forward_backward only", fb_times), ("forward_backward + optim_step", times)):
        print(label)
        print(f"{'tenants':>7} {'apart tok/s':>12} {'shared tok/s':>13} {'shared/apart':>13} {'shared vs 1 tenant':>19}")
        solo = None
        for n in args.tenants:
            apart = n * per_round / statistics.median(table[(n, "apart")])
            shared = n * per_round / statistics.median(table[(n, "shared")])
            solo = solo or apart
            print(f"{n:>7} {apart:>12.1f} {shared:>13.1f} {shared / apart:>13.3f} {shared / solo:>19.3f}")
    if args.merged:
        print_floors(args.tenants, times, fb_times)


def print_floors(tenants: list[int], times: dict, fb_times: dict) -> None:
    """A shared round's latency against one tenant's, and its floors (module docstring), in ms."""
    med = {k: 1e3 * statistics.median(v) for k, v in times.items()}
    fb = {k: 1e3 * statistics.median(v) for k, v in fb_times.items()}
    solo = med[(tenants[0], "shared")]
    print(f"latency of a round against {tenants[0]} tenant(s) ({solo:.0f} ms), engine only")
    print(f"{'tenants':>7} {'shared ms':>10} {'ratio':>6} {'merged ms':>10} {'floor: merged':>14} "
          f"{'optim/adapter ms':>17} {'floor: + optims':>16}")
    for n in tenants:
        shared, merged = med[(n, "shared")], med[(n, "merged")]
        optim = (shared - fb[(n, "shared")]) / n  # the shared round's optim_steps, one per adapter
        print(f"{n:>7} {shared:>10.0f} {shared / solo:>6.2f} {merged:>10.0f} {merged / solo:>14.2f} "
              f"{optim:>17.1f} {(merged + (n - 1) * optim) / solo:>16.2f}")


if __name__ == "__main__":
    main()
