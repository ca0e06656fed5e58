"""Crash isolation: what the engine process costs, and how fast tinkerd recovers when it dies.

1. Overhead: the same SDK training loop against a server with the engine in a thread and one with
   the engine in its own process, interleaved (A B A B), on the tiny model where a step is short
   and the pipe's share is largest. Prints steps/s of each and the ratio.
2. Chaos: the SDK loop while the engine process is SIGKILLed N times at random points; prints N,
   recovery time (median, max: restart + replay) and the replay length, and checks the losses
   equal an uninterrupted run's.

    python benchmarks/recovery.py --kills 10
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.chaos import TINY, Killer, recoveries, training_loop  # noqa: E402
from tests.serverproc import start_server  # noqa: E402


def overhead(rounds: int, steps: int, threads: int) -> None:
    root = Path(tempfile.mkdtemp(prefix="tinkerd-bench-"))
    servers = {e: start_server(root / e, [TINY], ["--threads", str(threads), "--engine", e]) for e in ("thread", "process")}
    times: dict[str, list[float]] = {e: [] for e in servers}
    try:
        for e, srv in servers.items():  # warm-up
            training_loop(srv.url, 2, sample_every=10**9)
        for _ in range(rounds):
            for e, srv in servers.items():
                t0 = time.perf_counter()
                training_loop(srv.url, steps, sample_every=10**9)
                times[e].append((time.perf_counter() - t0) / steps)
    finally:
        for srv in servers.values():
            srv.stop()
    print(f"overhead: tiny model, {steps} steps x {rounds} rounds, threads={threads}")
    for e, ts in times.items():
        print(f"  engine={e:8s} median {statistics.median(ts) * 1e3:7.1f} ms per step (fwd/bwd + optim, SDK round trips)")
    ratio = statistics.median(times["thread"]) / statistics.median(times["process"])
    print(f"  ratio process/thread throughput: {ratio:.3f}")


def chaos(kills: int, steps: int, threads: int) -> None:
    root = Path(tempfile.mkdtemp(prefix="tinkerd-chaos-"))
    ref_srv = start_server(root / "ref", [TINY], ["--threads", str(threads)])
    try:
        ref = training_loop(ref_srv.url, steps)
    finally:
        ref_srv.stop()
    srv = start_server(root / "chaos", [TINY], ["--threads", str(threads)])
    try:
        killer = Killer(srv.proc.pid, kills=kills, server_lines=srv.lines, min_gap_s=0.2, max_gap_s=0.8)
        killer.start()
        t0 = time.perf_counter()
        result = training_loop(srv.url, steps)
        wall = time.perf_counter() - t0
    finally:
        srv.stop()
    recs = recoveries(srv.lines)
    secs = [s for s, _ in recs]
    replayed = [n for _, n in recs]
    print(f"chaos: {len(killer.done)} SIGKILLs of the engine during {steps} steps ({wall:.1f} s wall)")
    if recs:
        print(f"  recovery time: median {statistics.median(secs):.2f} s, max {max(secs):.2f} s (restart + replay)")
        print(f"  replay length: median {statistics.median(replayed):.0f} ops, max {max(replayed)} ops")
    print(f"  losses identical to the uninterrupted run: {result.losses == ref.losses}; "
          f"samples identical: {result.samples == ref.samples}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--kills", type=int, default=10)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    overhead(args.rounds, 10, args.threads)
    chaos(args.kills, args.steps, args.threads)


if __name__ == "__main__":
    main()
