"""Event-loop lag and retrieve_future latency under 32 concurrent SDK clients: the API before the
async-boundary change (main) against it (HEAD), each checked out in a temp clone, on SQLite and on
PostgreSQL (a throwaway cluster, tests/postgres.py): four servers on the tiny model, measured in
turn, interleaved (before-sqlite, after-sqlite, before-pg, after-pg, then again each round).

Load, per client (one thread, one ServiceClient and its own run; 32 by default), for `--seconds`:
`RestClient.list_user_checkpoints` (the account's 32 checkpoints), a `forward` on its run (the
SDK's retrieve_future long-poll waits for the engine), `get_training_run`, and one raw
`retrieve_future` of an op that finished at set-up, timed: the latency a client sees for a cheap
answer while 31 others keep the server busy.

Lag: the same probe in both trees, injected by this script's `--boot` mode (the server it starts
is this file, which wraps `create_app` and runs `tinkerd.cli.main`): a task sleeping 50 ms on the
server's loop and recording how late it woke (api/looplag.py is the same probe, on /metrics, in
trees that have it).

    python benchmarks/event_loop.py [--clients 32 --seconds 20 --rounds 2 --threads 1 --before main --after HEAD]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROBE_S = 0.05


def boot(argv: list[str]) -> None:
    """`--boot TREE LAGFILE -- <python> -m tinkerd.cli.main ARGS`: run the server of TREE with the
    lag probe writing `<unix time> <lag s>` lines to LAGFILE."""
    import asyncio
    import contextlib
    import runpy

    tree, lagfile = argv[0], argv[1]
    args = argv[argv.index("tinkerd.cli.main") + 1:]
    os.chdir(tree)
    sys.path[0] = tree  # this script's directory was sys.path[0]: the tree's tinkerd must win
    import tinkerd.api.app as appmod

    create_app = appmod.create_app

    async def probe() -> None:
        with open(lagfile, "a", buffering=1) as out:
            while True:
                start = time.perf_counter()
                await asyncio.sleep(PROBE_S)
                out.write(f"{time.time():.3f} {max(0.0, time.perf_counter() - start - PROBE_S):.6f}\n")

    def probed(state):
        app = create_app(state)
        inner = app.router.lifespan_context

        @contextlib.asynccontextmanager
        async def lifespan(a):
            task = asyncio.get_running_loop().create_task(probe())
            async with inner(a) as value:
                yield value
            task.cancel()

        app.router.lifespan_context = lifespan
        return app

    appmod.create_app = probed
    sys.argv = ["tinkerd", *args]
    runpy.run_module("tinkerd.cli.main", run_name="__main__", alter_sys=True)


def percentile(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))] if s else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--before", default="main", help="the git ref of the 'before' tree")
    ap.add_argument("--after", default="HEAD", help="the git ref of the 'after' tree")
    args = ap.parse_args()

    import shutil
    import subprocess
    import tempfile
    import threading

    import httpx
    import tinker
    from tinker import types

    sys.path.insert(0, str(ROOT))
    from benchmarks.metrics_overhead import _machine_cpu_s
    from benchmarks.recovery import _proc_stat
    from tests.chaos import TINY, engine_pid
    from tests.postgres import Cluster, fresh_database
    from tests.serverproc import API_KEY, share_models, start_server

    work = Path(tempfile.mkdtemp(prefix="tinkerd-bench-loop-"))
    trees, revs = {}, {}
    for side, ref in (("before", args.before), ("after", args.after)):
        # Both sides from commits, each in a temp clone: an edit in this checkout during the run
        # changes neither.
        trees[side] = work / f"tree-{side}"
        subprocess.run(["git", "clone", "-q", "--no-checkout", str(ROOT), str(trees[side])], check=True)
        sha = subprocess.run(["git", "-C", str(ROOT), "rev-parse", ref], capture_output=True, text=True, check=True)
        subprocess.run(["git", "-C", str(trees[side]), "checkout", "-q", sha.stdout.strip()], check=True)
        revs[side] = sha.stdout.strip()[:7]
    (work / "models").mkdir()
    share_models(work / "models")  # the tiny models are built once, by the first server
    cluster = Cluster()
    cluster.start()
    servers, lagfiles = {}, {}
    try:
        def start(name: str, tree: Path, backend: str) -> None:
            lagfiles[name] = work / f"{name}.lag"
            extra = ["--threads", str(args.threads)]
            if backend == "postgresql":
                extra += ["--db-url", fresh_database(cluster.url())]
            servers[name] = start_server(work / name, [TINY], extra, launcher=[
                sys.executable, str(Path(__file__).resolve()), "--boot", str(tree), str(lagfiles[name]), "--"])

        configs = [(f"{side}-{backend}", tree, backend) for backend in ("sqlite", "postgresql")
                   for side, tree in trees.items()]
        for c in configs:  # one at a time: four tiny-model builds at once crowd two cores
            start(*c)

        data = [types.Datum(model_input=types.ModelInput.from_ints(list(range(1, 17))),
                            loss_fn_inputs={"target_tokens": list(range(2, 18))})]

        def set_up(url: str) -> list[tuple]:
            """Per client: its ServiceClient's training client, rest client and a finished op's id."""
            clients = [None] * args.clients

            def one(i: int) -> None:
                sc = tinker.ServiceClient(base_url=url, api_key=API_KEY)
                tc = sc.create_lora_training_client(base_model=TINY, rank=2, seed=i).result()
                tc.save_state(f"c{i}").result()
                with httpx.Client(base_url=url, headers={"X-API-Key": API_KEY}, timeout=120) as h:
                    session = types.CreateSessionRequest(tags=[], user_metadata=None, sdk_version=tinker.__version__)
                    r = h.post("/api/v1/create_session", json=session.model_dump(mode="json"))
                    create = types.CreateModelRequest(session_id=r.json()["session_id"], model_seq_id=0, base_model=TINY,
                                                      lora_config=types.LoraConfig(rank=2))
                    r = h.post("/api/v1/create_model", json=create.model_dump(mode="json"))
                    assert r.status_code == 200, r.text
                    rid = r.json()["request_id"]
                    while h.post("/api/v1/retrieve_future", json={"request_id": rid}).status_code != 200:
                        pass
                clients[i] = (tc, tinker.RestClient(base_url=url, api_key=API_KEY), rid)

            threads = [threading.Thread(target=one, args=(i,)) for i in range(args.clients)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            assert all(clients), "a client's set-up failed"
            return clients

        clients = {name: set_up(srv.url) for name, srv in servers.items()}
        figures = {name: {"lag": [], "retrieve": [], "ops": 0, "cpu": 0.0, "wall": 0.0} for name in servers}
        machine0, own_cpu, t_all = _machine_cpu_s(), 0.0, time.perf_counter()
        for _ in range(args.rounds):
            for name, srv in servers.items():
                fig = figures[name]
                stop = time.monotonic() + args.seconds
                lock = threading.Lock()

                def client(tc, rest, rid) -> None:
                    latencies, ops = [], 0
                    with httpx.Client(base_url=srv.url, headers={"X-API-Key": API_KEY}, timeout=120) as h:
                        while time.monotonic() < stop:
                            rest.list_user_checkpoints(limit=100).result()
                            tc.forward(data, "cross_entropy").result()
                            rest.get_training_run(tc.model_id).result()
                            t0 = time.perf_counter()
                            r = h.post("/api/v1/retrieve_future", json={"request_id": rid})
                            latencies.append(time.perf_counter() - t0)
                            assert r.status_code == 200, r.text
                            ops += 4
                    with lock:
                        fig["retrieve"] += latencies
                        fig["ops"] += ops

                pids = {srv.proc.pid, engine_pid(srv.proc.pid)}
                cpu0 = sum(_proc_stat(p)[0] for p in pids)
                t_start, w0 = time.time(), time.perf_counter()
                threads = [threading.Thread(target=client, args=c) for c in clients[name]]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join()
                t_end = time.time()
                fig["wall"] += time.perf_counter() - w0
                used = sum(_proc_stat(p)[0] for p in pids) - cpu0
                fig["cpu"] += used
                own_cpu += used
                for line in lagfiles[name].read_text().splitlines():
                    at, lag = map(float, line.split())
                    if t_start <= at <= t_end:
                        fig["lag"].append(lag)
        wall = time.perf_counter() - t_all
        others = _machine_cpu_s() - machine0 - own_cpu
    finally:
        for srv in servers.values():
            srv.stop()
        cluster.stop()
        shutil.rmtree(work, ignore_errors=True)  # two clones, four data dirs and their models

    load = os.getloadavg()
    print(f"event loop: {args.clients} SDK clients x {args.seconds:g} s x {args.rounds} rounds interleaved, tiny model, "
          f"threads={args.threads}; before = {args.before} ({revs['before']}), after = {args.after} ({revs['after']}); "
          f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} on {os.cpu_count()} CPUs; "
          f"CPU used outside the servers meanwhile {others:.1f} s in {wall:.1f} s (these clients included)")
    print(f"  {'server':18s} {'lag p50':>9s} {'lag p99':>9s} {'lag max':>9s} {'retr p50':>9s} {'retr p99':>9s} "
          f"{'ops/s':>7s} {'CPU s':>6s}")
    for name, fig in figures.items():
        print(f"  {name:18s} {percentile(fig['lag'], .5) * 1e3:7.1f}ms {percentile(fig['lag'], .99) * 1e3:7.1f}ms "
              f"{max(fig['lag'], default=float('nan')) * 1e3:7.1f}ms {percentile(fig['retrieve'], .5) * 1e3:7.1f}ms "
              f"{percentile(fig['retrieve'], .99) * 1e3:7.1f}ms {fig['ops'] / fig['wall']:7.1f} {fig['cpu']:6.1f}"
              f"   ({len(fig['lag'])} lag samples, {len(fig['retrieve'])} retrieves)")
    for backend in ("sqlite", "postgresql"):
        b, a = figures[f"before-{backend}"], figures[f"after-{backend}"]
        print(f"  {backend}: after/before lag p99 {percentile(a['lag'], .99) / percentile(b['lag'], .99):.3f}, "
              f"retrieve p50 {percentile(a['retrieve'], .5) / percentile(b['retrieve'], .5):.3f}, "
              f"retrieve p99 {percentile(a['retrieve'], .99) / percentile(b['retrieve'], .99):.3f}, "
              f"ops/s {(a['ops'] / a['wall']) / (b['ops'] / b['wall']):.3f}")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--boot":
        boot(sys.argv[2:])
    else:
        main()
