"""The replicated topology for the tests (docs/deployment.md): two `tinkerd serve --role api`
processes behind a real HAProxy and one `--role worker` driving the engine, on a throwaway
PostgreSQL cluster of its own (tests/postgres.py: Cluster; test_replicas restarts it) and one data
directory (checkpoints are files).

A `Topology` stands where a `ServerProcess` does (`url`, `data_dir`, `env`, `cli_env()`), so a
conformance test parametrized over its server runs unchanged through the load balancer; `doors`
are the replicas' own URLs, for a test that asks each of them directly.
"""

from __future__ import annotations

import socket
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator

import httpx

from tests import serverproc
from tests.serverproc import ServerProcess, start_server

# What the shared topology runs with (tests/conformance/conftest.py: replicas_server):
# - a 1 s long-poll hold on the replicas: test_quotas' pause tests see a paused op on the wire
#   within a second (as on the timers server);
# - a budget of 8 waiting ops per target: test_replicas' back-pressure test fills it; the other
#   tests on it (the fault tests' 8 pipelined ops among them) never have 8 waiting.
REPLICA_ARGS = ["--retrieve-future-timeout-s", "1", "--max-queued-ops-per-model", "8"]
WORKER_ARGS = ["--threads", "2", "--sample-kv-cache-gb", "0.01", *REPLICA_ARGS]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def haproxy_config(port: int, stats_port: int, backends: list[int]) -> str:
    servers = "\n".join(f"  server api{i} 127.0.0.1:{p} check" for i, p in enumerate(backends))
    # Balanced per request (HTTP mode), so one SDK client's calls alternate between the replicas.
    # Health checks every 0.2 s take a dead replica out within ~0.4 s; `retries` + `redispatch` send a
    # request whose connection was refused to the other one. Timeouts above the 20 s long-poll hold.
    # http-no-delay: without it HAProxy corks a streamed response (MSG_MORE) and an OpenAI stream's
    # chunks arrive in ~200 ms bursts instead of token by token (test_openai's live stream).
    return f"""global
  maxconn 2000
defaults
  mode http
  timeout connect 2s
  timeout client 120s
  timeout server 120s
  retries 3
  option redispatch
  option http-no-delay
frontend api
  bind 127.0.0.1:{port}
  default_backend replicas
backend replicas
  balance roundrobin
  option httpchk GET /api/v1/healthz
  default-server inter 200ms fall 2 rise 2
{servers}
listen stats
  bind 127.0.0.1:{stats_port}
  stats enable
  stats uri /stats
"""


@dataclass
class Topology:
    url: str  # the load balancer
    db_url: str
    worker: ServerProcess
    replicas: list[ServerProcess]
    replica_args: list[list[str]]
    haproxy: subprocess.Popen
    stats_url: str
    cluster: object  # tests/postgres.py: Cluster
    env: dict = field(default_factory=dict)

    @property
    def data_dir(self):
        return self.worker.data_dir

    @property
    def doors(self) -> list[str]:
        """Each replica's own URL, past the load balancer."""
        return [r.url for r in self.replicas]

    def cli_env(self) -> dict:
        return self.worker.cli_env()

    def requests_per_replica(self) -> dict[str, int]:
        csv = httpx.get(f"{self.stats_url};csv", timeout=10).text.splitlines()
        cols = csv[0].lstrip("# ").split(",")
        rows = [dict(zip(cols, line.split(","))) for line in csv[1:] if line]
        return {r["svname"]: int(r["stot"] or 0) for r in rows if r["pxname"] == "replicas" and r["svname"].startswith("api")}


@contextmanager
def topology(data, models: list[str]) -> Iterator[Topology]:
    """Start the cluster, the driver, two replicas and HAProxy; stop them all (by PID) at the end."""
    from tests.postgres import Cluster, fresh_database

    cluster = Cluster()
    cluster.start()
    db_url = fresh_database(cluster.url())
    env = {"TINKERD_DB_URL": db_url}
    if serverproc._shared_models_dir is not None:  # linked once here, not by three starts at once
        (data / "models").symlink_to(serverproc._shared_models_dir, target_is_directory=True)
    started: list[ServerProcess] = []
    haproxy = None
    try:
        ports = [free_port(), free_port()]
        args = [["--db-url", db_url, "--role", "api", "--port", str(p), *REPLICA_ARGS] for p in ports]
        # The replicas start beside the driver (each waits for the driver's models, control/replicas.py)
        # and print their ready line after it.
        with ThreadPoolExecutor(3) as pool:
            replicas = [pool.submit(start_server, data, models, a, env=env) for a in args]
            worker = start_server(data, models, [*WORKER_ARGS, "--db-url", db_url, "--role", "worker"], env=env)
            started.append(worker)
            for f in replicas:
                started.append(f.result())
        lb_port, stats_port = free_port(), free_port()
        cfg = data / "haproxy.cfg"
        cfg.write_text(haproxy_config(lb_port, stats_port, ports))
        haproxy = subprocess.Popen(["haproxy", "-f", str(cfg), "-db"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        url = f"http://127.0.0.1:{lb_port}"
        for _ in range(100):
            try:
                if httpx.get(f"{url}/api/v1/healthz", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        yield Topology(url, db_url, worker, started[1:], args, haproxy, f"http://127.0.0.1:{stats_port}/stats",
                       cluster, env)
    finally:
        if haproxy is not None:
            haproxy.terminate()
            haproxy.wait(timeout=10)
        for srv in started:
            srv.stop()
        cluster.stop()
