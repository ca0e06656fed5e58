"""What GET /metrics costs an SDK loop: the same pipelined training loop (forward_backward +
optim_step, a sample every few steps; tests/chaos.py: training_loop) against two servers started
side by side on the tiny model, interleaved A B A B:

  A  metrics on (the default), scraped every `--scrape-interval-s` by a thread meanwhile
     (Prometheus scrapes every 15-60 s; the default 1 s is a heavier load than any real scraper);
  B  `--no-metrics`: nothing counted, nothing timed, no endpoint.

Prints each side's median wall ms per step and the server's CPU ms per step (server + engine
process), the ratios A/B, the scrapes made, and the CPU other processes used meanwhile.

    python benchmarks/metrics_overhead.py [--rounds 5 --steps 10 --threads 1]

Measured once (at 59e081f, 5 rounds x 10 steps, threads=1, 157 scrapes at 1 s, on 2 CPUs
shared with six other engineers' test runs: load average 7.5-10): metrics 1739 ms/step, no-metrics
1745 ms/step median wall, ratio 0.997; server CPU 568 vs 540 ms/step, ratio 1.052 (the once-a-second
scrapes included). Rounds swung 1247-1917 ms on each side, so both ratios are within that noise.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.recovery import _proc_stat  # noqa: E402
from tests.chaos import TINY, engine_pid, training_loop  # noqa: E402
from tests.serverproc import start_server  # noqa: E402


def _machine_cpu_s() -> float:
    """CPU seconds all processes used so far (/proc/stat: user + nice + system + irq + softirq)."""
    fields = [int(x) for x in open("/proc/stat").readline().split()[1:]]
    return (fields[0] + fields[1] + fields[2] + fields[5] + fields[6]) / os.sysconf("SC_CLK_TCK")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--scrape-interval-s", type=float, default=1.0)
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="tinkerd-bench-metrics-"))
    common = ["--threads", str(args.threads)]
    servers = {"metrics": start_server(root / "a", [TINY], common),
               "no-metrics": start_server(root / "b", [TINY], common + ["--no-metrics"])}
    times = {k: [] for k in servers}
    cpu = {k: [] for k in servers}
    scrapes = [0]
    stop = threading.Event()

    def scraper(url: str) -> None:
        with httpx.Client(timeout=30) as client:
            while not stop.wait(args.scrape_interval_s):
                client.get(f"{url}/metrics").raise_for_status()
                scrapes[0] += 1

    try:
        for srv in servers.values():  # warm-up: the first run of each code path
            training_loop(srv.url, 2, sample_every=2)
        threading.Thread(target=scraper, args=(servers["metrics"].url,), daemon=True).start()
        own_cpu, machine0, t_all = 0.0, _machine_cpu_s(), time.perf_counter()
        for _ in range(args.rounds):
            for name, srv in servers.items():
                pids = {srv.proc.pid, engine_pid(srv.proc.pid)}
                before = sum(_proc_stat(p)[0] for p in pids)
                t0 = time.perf_counter()
                training_loop(srv.url, args.steps, sample_every=5)
                times[name].append((time.perf_counter() - t0) / args.steps)
                used = sum(_proc_stat(p)[0] for p in pids) - before
                cpu[name].append(used / args.steps)
                own_cpu += used
        wall = time.perf_counter() - t_all
        others = _machine_cpu_s() - machine0 - own_cpu
    finally:
        stop.set()
        for srv in servers.values():
            srv.stop()
    print(f"metrics overhead: tiny model, {args.steps} steps x {args.rounds} rounds interleaved, threads={args.threads}, "
          f"scrape every {args.scrape_interval_s:g} s ({scrapes[0]} scrapes); load average {os.getloadavg()[0]:.2f} "
          f"on {os.cpu_count()} CPUs; CPU used outside the two servers meanwhile {others:.1f} s in {wall:.1f} s "
          f"(this client included)")
    for name in servers:
        print(f"  {name:10s} median {statistics.median(times[name]) * 1e3:7.1f} ms/step wall "
              f"(rounds {', '.join(f'{t * 1e3:.0f}' for t in times[name])}); "
              f"CPU {statistics.median(cpu[name]) * 1e3:6.1f} ms/step (server + engine)")
    wall_ratio = statistics.median(times["metrics"]) / statistics.median(times["no-metrics"])
    cpu_ratio = statistics.median(cpu["metrics"]) / statistics.median(cpu["no-metrics"])
    print(f"  ratio metrics/no-metrics: {wall_ratio:.3f} (wall per step), {cpu_ratio:.3f} (server CPU per step)")


if __name__ == "__main__":
    main()
