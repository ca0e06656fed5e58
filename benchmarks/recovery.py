"""Crash isolation: what the engine process costs, and how fast tinkerd recovers when it dies.

1. Overhead: the same SDK training loop against a server with the engine in a thread and one with
   the engine in its own process, interleaved (A B A B), on the tiny model where a step is short
   and the pipe's share is largest. Prints ms per step of each, their CPU (server plus engine
   process) and the engine's page faults per step, and the ratios. A pipe round trip alone is
   ~30 us; see benchmarks/engine_malloc.py for what malloc's page faults cost a step.
2. Chaos: the SDK loop while the engine process is SIGKILLed N times at random points; prints N,
   recovery time (median, max: restart + replay) and the replay length, and checks the losses
   equal an uninterrupted run's.

    python benchmarks/recovery.py --kills 10
    python benchmarks/recovery.py --overhead-only --rounds 5
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.chaos import TINY, Killer, engine_pid, recoveries, training_loop  # noqa: E402
from tests.serverproc import start_server  # noqa: E402


def _proc_stat(pid: int | None) -> tuple[float, int]:
    """(CPU seconds, minor page faults) of a process so far; zeros once it is gone."""
    try:
        fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    except (OSError, TypeError):
        return 0.0, 0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK"), int(fields[7])


def overhead(rounds: int, steps: int, threads: int) -> None:
    """Wall time per step is what a user sees, but on a shared machine it swings by 20% from round
    to round; the CPU time of the server plus its engine process, and the engine's minor page
    faults, are the steadier signals of what the engine process itself costs."""
    root = Path(tempfile.mkdtemp(prefix="tinkerd-bench-"))
    servers = {e: start_server(root / e, [TINY], ["--threads", str(threads), "--engine", e]) for e in ("thread", "process")}
    times: dict[str, list[float]] = {e: [] for e in servers}
    cpu: dict[str, list[float]] = {e: [] for e in servers}
    faults: dict[str, list[float]] = {e: [] for e in servers}
    try:
        for e, srv in servers.items():  # warm-up
            training_loop(srv.url, 2, sample_every=10**9)
        for _ in range(rounds):
            for e, srv in servers.items():
                engine = srv.proc.pid if e == "thread" else engine_pid(srv.proc.pid)
                pids = {srv.proc.pid, engine}
                before = {pid: _proc_stat(pid) for pid in pids}
                t0 = time.perf_counter()
                training_loop(srv.url, steps, sample_every=10**9)
                times[e].append((time.perf_counter() - t0) / steps)
                after = {pid: _proc_stat(pid) for pid in pids}
                cpu[e].append(sum(after[p][0] - before[p][0] for p in pids) / steps)
                faults[e].append((after[engine][1] - before[engine][1]) / steps)
    finally:
        for srv in servers.values():
            srv.stop()
    print(f"overhead: tiny model, {steps} steps x {rounds} rounds interleaved, threads={threads}, "
          f"load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs")
    for e, ts in times.items():
        print(f"  engine={e:8s} median {statistics.median(ts) * 1e3:7.1f} ms per step (fwd/bwd + optim, SDK round trips); "
              f"CPU {statistics.median(cpu[e]) * 1e3:6.1f} ms/step (server + engine); "
              f"{statistics.median(faults[e]):7.0f} engine page faults/step")
    ratio = statistics.median(times["thread"]) / statistics.median(times["process"])
    cpu_ratio = statistics.median(cpu["thread"]) / statistics.median(cpu["process"])
    print(f"  ratio process/thread throughput: {ratio:.3f} (wall), {cpu_ratio:.3f} (CPU)")


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
    ap.add_argument("--overhead-only", action="store_true", help="skip the chaos part")
    args = ap.parse_args()
    overhead(args.rounds, 10, args.threads)
    if not args.overhead_only:
        chaos(args.kills, args.steps, args.threads)


if __name__ == "__main__":
    main()
