"""Concurrent training tenants on one base model: aggregate tokens/s and per-client step latency.

N = 1, 2, 4, 8 (`--tenants`) official SDK clients, each its own ServiceClient in its own thread with
its own LoRA adapter (same rank, same per-client batch), train at once against one server: each
client loops forward_backward + optim_step and waits for both before its next step, as a plain SFT
loop does. The phases are interleaved (1 2 4 8 1 2 4 8 ...) over `--rounds`, so machine noise hits
every N alike. For each N it prints the aggregate tokens/s (every client's tokens over the phase's
wall time), the median and worst per-client step latency, and both as ratios to N = 1: with one
engine running one op at a time the aggregate stays flat and latency grows ~N-fold; batching
tenants into one pass is what moves these ratios. Then, from the server's metrics, the
forward_backward passes the engine ran per round of client steps (1 when every round's ops of all
N clients shared one pass, N when each ran alone) and the mean engine time of a pass and of an
optim_step; last, the CPU this process (the N SDK clients, on the same cores as the server) spent
per client step. The issue's targets: at N = 4, aggregate >= 1.5x and no client's latency > 1.5x
its solo one.

    python benchmarks/training_tenants.py                         # SmolLM2-135M, 2 x 128 per client, 1 thread
    python benchmarks/training_tenants.py --tenants 1,4 --rounds 3 --threads 2
    python benchmarks/training_tenants.py --server-args="--dtype bfloat16"
    python benchmarks/training_tenants.py --tenants 1,4 --rows 1 --tokens 8 --threads 2 --steps 30 --client-processes

`--client-processes` runs each client in a process of its own, as separate tenants' programs are,
instead of a thread of this one (whose GIL the clients share). On 2 cores it changed nothing
(1 x 8 tokens, 2 threads, 2 rounds of 30 steps, alternated: threads 1.75x aggregate and 2.00x
worst latency, processes 1.88x and 2.06x): the clients' CPU (6-9 ms a step), not their GIL, is
what they cost the server. Short phases (`--steps` of a few) read lower than a long run: clients
that start together split into two or three passes first and come together within a few steps.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import shlex
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import tinker  # noqa: E402
from tinker import types  # noqa: E402

from benchmarks.training import cpu_jiffies, load_average, make_batch  # noqa: E402
from tests.serverproc import API_KEY, share_models, start_server  # noqa: E402


class Tenant:
    def __init__(self, url: str, model: str, rank: int, batch: np.ndarray, seed: int):
        sc = tinker.ServiceClient(base_url=url, api_key=API_KEY)
        self.tc = sc.create_lora_training_client(base_model=model, rank=rank, seed=seed).result()
        self.data = [types.Datum(model_input=types.ModelInput.from_ints(row[:-1].tolist()),
                                 loss_fn_inputs={"target_tokens": row[1:].tolist()}) for row in batch]

    def step(self) -> float:
        fb = self.tc.forward_backward(self.data, "cross_entropy")
        opt = self.tc.optim_step(types.AdamParams(learning_rate=1e-4))
        fb.result()
        opt.result()
        return 0.0


def phase(tenants: list[Tenant], steps: int) -> tuple[float, list[list[float]]]:
    """Every tenant runs `steps` steps at once; (wall seconds, each tenant's step latencies)."""
    latencies: list[list[float]] = [[] for _ in tenants]
    start = threading.Barrier(len(tenants) + 1)

    def loop(i: int) -> None:
        start.wait()
        for _ in range(steps):
            t0 = time.perf_counter()
            tenants[i].step()
            latencies[i].append(time.perf_counter() - t0)

    threads = [threading.Thread(target=loop, args=(i,)) for i in range(len(tenants))]
    for t in threads:
        t.start()
    start.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    return time.perf_counter() - t0, latencies


class ClientProcess:
    """A Tenant in a process of its own (`--client-processes`): tenants are separate programs, each
    with its own interpreter, not threads sharing this one's GIL."""

    def __init__(self, ctx, url: str, model: str, rank: int, batch: np.ndarray, seed: int):
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_client_main, args=(child, url, model, rank, batch, seed), daemon=True)
        self.proc.start()

    def ready(self) -> None:
        if self.conn.recv() != "ready":
            raise RuntimeError("a client process failed to start")

    def close(self) -> None:
        self.conn.send(None)
        self.proc.join(timeout=30)


def _client_main(conn, url: str, model: str, rank: int, batch: np.ndarray, seed: int) -> None:
    tenant = Tenant(url, model, rank, batch, seed)
    tenant.step()  # warm-up: first-step allocations, the optimizer's state
    conn.send("ready")
    while (msg := conn.recv()) is not None:
        steps, start_at = msg
        time.sleep(max(0.0, start_at - time.time()))
        cpu0, latencies = time.process_time(), []
        for _ in range(steps):
            t0 = time.perf_counter()
            tenant.step()
            latencies.append(time.perf_counter() - t0)
        conn.send((latencies, time.time(), time.process_time() - cpu0))


def phase_in_processes(clients: list[ClientProcess], steps: int) -> tuple[float, list[list[float]], float]:
    """phase() with each tenant in its own process: (wall seconds, each tenant's step latencies,
    the clients' CPU seconds). They start together at a wall-clock time a little ahead."""
    start_at = time.time() + 0.2
    for c in clients:
        c.conn.send((steps, start_at))
    results = [c.conn.recv() for c in clients]
    return max(r[1] for r in results) - start_at, [r[0] for r in results], sum(r[2] for r in results)


def engine_counts(url: str) -> dict[str, float]:
    """What the server's metrics say so far: `passes`, the forward_backward passes run (a pass of
    several runs counts once, tinkerd_shared_pass_runs_count; an op that ran alone is a pass of its
    own), and per op type the engine seconds and op count (a shared pass's wall is every one of its
    ops' engine time, so seconds / count is the mean pass an op waited through)."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    c = {"passes": 0.0, "fb_s": 0.0, "fb_n": 0.0, "opt_s": 0.0, "opt_n": 0.0}
    kinds = {"ForwardBackward": "fb", "OptimStep": "opt"}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=30).text):
        for s in family.samples:
            if s.name == "tinkerd_shared_pass_runs_count":
                c["passes"] += s.value
            elif s.name == "tinkerd_shared_pass_runs_sum":
                c["passes"] -= s.value  # counted below among all forward_backward ops; alone = all - shared
            elif s.name.startswith("tinkerd_op_engine_seconds_") and s.labels.get("type") in kinds:
                kind = kinds[s.labels["type"]]
                if s.name.endswith("_count"):
                    c[kind + "_n"] += s.value
                    c["passes"] += s.value if kind == "fb" else 0.0
                elif s.name.endswith("_sum"):
                    c[kind + "_s"] += s.value
    return c


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="HuggingFaceTB/SmolLM2-135M-Instruct")
    ap.add_argument("--data-dir", default="/tmp/tinkerd-bench", help="its models/ is reused")
    ap.add_argument("--tenants", default="1,2,4,8")
    ap.add_argument("--rows", type=int, default=2, help="datums per client step")
    ap.add_argument("--tokens", type=int, default=128, help="tokens per datum")
    ap.add_argument("--rank", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=2, help="passes over every N")
    ap.add_argument("--steps", type=int, default=2, help="steps per client per phase")
    ap.add_argument("--server-args", default="", help="extra `tinkerd serve` arguments, e.g. '--dtype bfloat16'")
    ap.add_argument("--client-processes", action="store_true",
                    help="each SDK client in a process of its own instead of a thread of this one")
    args = ap.parse_args()
    os.environ.setdefault("TINKER_TELEMETRY", "0")
    counts = [int(n) for n in args.tenants.split(",")]
    base = Path(args.data_dir).resolve()
    (base / "models").mkdir(parents=True, exist_ok=True)
    share_models(base / "models")
    data_dir = Path(tempfile.mkdtemp(prefix="tenants-", dir=base))
    server = start_server(data_dir, [args.model], ["--threads", str(args.threads), *shlex.split(args.server_args)])
    clients: list[ClientProcess] = []  # with --client-processes, to stop at the end
    try:
        from transformers import AutoConfig

        from tinkerd.engine.model.registry import cache_dir_for

        model_dir = cache_dir_for(args.model, base / "models")
        vocab = AutoConfig.from_pretrained(str(model_dir) if model_dir.exists() else args.model).vocab_size
        # Each tenant its own data and adapter seed: nothing is shared but the base model.
        batches = [make_batch(vocab, args.rows, args.tokens, seed=i) for i in range(max(counts))]
        if args.client_processes:
            ctx = multiprocessing.get_context("spawn")
            tenants = clients = [ClientProcess(ctx, server.url, args.model, args.rank, batches[i], seed=i)
                                 for i in range(max(counts))]
            for t in tenants:
                t.ready()
        else:
            tenants = [Tenant(server.url, args.model, args.rank, batches[i], seed=i) for i in range(max(counts))]
            for t in tenants:  # warm-up: first-step allocations, the optimizer's state
                t.step()
        load_before = load_average()
        busy0, total0 = cpu_jiffies()
        walls: dict[int, list[float]] = {n: [] for n in counts}
        lats: dict[int, list[list[float]]] = {n: [] for n in counts}
        # Per N, the server's counts over all its phases (engine_counts) and the clients' own CPU: the
        # SDK clients run in this process and share the machine's cores with the server.
        seen: dict[int, dict[str, float]] = {n: {} for n in counts}
        client_cpu: dict[int, float] = {n: 0.0 for n in counts}
        for _ in range(args.rounds):
            for n in counts:
                before, cpu0 = engine_counts(server.url), time.process_time()
                if args.client_processes:
                    wall, lat, cpu = phase_in_processes(tenants[:n], args.steps)
                else:
                    wall, lat = phase(tenants[:n], args.steps)
                    cpu = time.process_time() - cpu0
                client_cpu[n] += cpu
                after = engine_counts(server.url)
                for k in after:
                    seen[n][k] = seen[n].get(k, 0.0) + after[k] - before[k]
                walls[n].append(wall)
                lats[n].extend(lat)
        busy1, total1 = cpu_jiffies()
    finally:
        for c in clients:
            c.close()
        server.stop()
        shutil.rmtree(data_dir, ignore_errors=True)

    tokens = args.rows * args.tokens
    print(f"model={args.model} threads={args.threads} server_args={args.server_args!r} per-client batch="
          f"{args.rows}x{args.tokens} rank={args.rank} steps/client/phase={args.steps} rounds={args.rounds} cpus={os.cpu_count()} "
          f"clients in {'processes' if args.client_processes else 'threads of this process'}")
    print(f"load average before: {load_before}, after: {load_average()}; machine busy "
          f"{100 * (busy1 - busy0) / max(1, total1 - total0):.0f}% during the run (all processes)")
    # Passes per round: N when every round's forward_backward ops of the N clients share one pass.
    # Where a client's step goes: the forward_backward pass it waits through and its optim_step in the
    # engine (means per op), and the SDK clients' CPU per client step (this process, on the same cores).
    print("| tenants | aggregate tokens/s | x N=1 | median client step ms | worst client median ms | worst / solo "
          "| fb passes per round | engine ms per fb pass | engine ms per optim_step | client CPU ms per step |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    solo_rate = solo_lat = None
    for n in counts:
        rate = n * args.steps * tokens / float(np.median(walls[n]))
        per_client = [float(np.median(np.concatenate([lats[n][r * n + i] for r in range(args.rounds)]))) for i in range(n)]
        med, worst = float(np.median(per_client)), max(per_client)
        if solo_rate is None:
            solo_rate, solo_lat = rate, med
        print(f"| {n} | {rate:.1f} | {rate / solo_rate:.2f} | {med * 1e3:.0f} | {worst * 1e3:.0f} | {worst / solo_lat:.2f} "
              f"| {seen[n]['passes'] / (args.rounds * args.steps):.2f} | {1e3 * seen[n]['fb_s'] / max(1, seen[n]['fb_n']):.0f} "
              f"| {1e3 * seen[n]['opt_s'] / max(1, seen[n]['opt_n']):.0f} "
              f"| {1e3 * client_cpu[n] / (n * args.rounds * args.steps):.0f} |")


if __name__ == "__main__":
    main()
