"""Stateless API replicas (docs/deployment.md): two `tinkerd serve --role api` processes behind a
real HAProxy, one `--role worker` driving the engine, all on one real PostgreSQL, through the
unmodified SDK. Losses, samples and checkpoints equal the embedded SQLite server's (`server`) bit for
bit; ownership and (model_id, seq_id) idempotency hold whichever replica a request lands on; and a
pipelined training loop through the load balancer outlives a kill -9 of one replica with every loss
equal to the uninterrupted run. One topology for the module (a start is ~4 processes)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import httpx
import pytest
import tinker
from tinker import types

from tests.conformance.conftest import TINY
from tests.conformance.test_quotas import _key
from tests.conformance.test_retention import ADAM, _batch, _train
from tests import serverproc
from tests.serverproc import API_KEY, ServerProcess, start_server


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _haproxy_config(port: int, stats_port: int, backends: list[int]) -> str:
    servers = "\n".join(f"  server api{i} 127.0.0.1:{p} check" for i, p in enumerate(backends))
    # Balanced per request (HTTP mode), so one SDK client's calls alternate between the replicas.
    # Health checks every 0.2 s take a dead replica out within ~0.4 s; `retries` + `redispatch` send a
    # request whose connection was refused to the other one. Timeouts above the 20 s long-poll hold.
    return f"""global
  maxconn 2000
defaults
  mode http
  timeout connect 2s
  timeout client 120s
  timeout server 120s
  retries 3
  option redispatch
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

    def requests_per_replica(self) -> dict[str, int]:
        csv = httpx.get(f"{self.stats_url};csv", timeout=10).text.splitlines()
        cols = csv[0].lstrip("# ").split(",")
        rows = [dict(zip(cols, line.split(","))) for line in csv[1:] if line]
        return {r["svname"]: int(r["stot"] or 0) for r in rows if r["pxname"] == "replicas" and r["svname"].startswith("api")}


@pytest.fixture(scope="module")
def topology(tmp_path_factory):
    from tests.postgres import Cluster, fresh_database

    # A cluster of the module's own, not the session's: one test restarts it.
    cluster = Cluster()
    cluster.start()
    db_url = fresh_database(cluster.url())
    env = {"TINKERD_DB_URL": db_url}
    data = tmp_path_factory.mktemp("replicas-data")  # one data directory: checkpoints are files
    if serverproc._shared_models_dir is not None:  # linked once here, not by three starts at once
        (data / "models").symlink_to(serverproc._shared_models_dir, target_is_directory=True)
    started: list[ServerProcess] = []
    haproxy = None
    try:
        ports = [_free_port(), _free_port()]
        args = [["--db-url", db_url, "--role", "api", "--port", str(p)] for p in ports]
        # The replicas start beside the driver (each waits for the driver's models, control/replicas.py)
        # and print their ready line after it.
        with ThreadPoolExecutor(3) as pool:
            replicas = [pool.submit(start_server, data, [TINY], a, env=env) for a in args]
            worker = start_server(data, [TINY], ["--threads", "2", "--sample-kv-cache-gb", "0.01", "--db-url", db_url,
                                                 "--role", "worker"], env=env)
            started.append(worker)
            for f in replicas:
                started.append(f.result())
        lb_port, stats_port = _free_port(), _free_port()
        cfg = data / "haproxy.cfg"
        cfg.write_text(_haproxy_config(lb_port, stats_port, ports))
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


def _sc(url: str, key: str = API_KEY) -> tinker.ServiceClient:
    return tinker.ServiceClient(base_url=url, api_key=key)


SAMPLING = types.SamplingParams(max_tokens=6, temperature=1.0, seed=3, stop=[])


def _loop(url: str) -> tuple[list[float], list]:
    """The SL loop, a checkpoint for sampling, and seeded samples from it."""
    sc = _sc(url)
    tc = sc.create_lora_training_client(base_model=TINY, rank=8, seed=11).result()
    losses = _train(tc, range(3))
    path = tc.save_weights_for_sampler("replicas").result().path
    sampler = sc.create_sampling_client(model_path=path).result()
    res = sampler.sample(types.ModelInput.from_ints([3, 1, 4, 1, 5]), 2, SAMPLING).result()
    return losses, [(s.tokens, s.logprobs) for s in res.sequences]


def test_an_sdk_loop_through_the_load_balancer_equals_the_embedded_server(server, topology):
    before = topology.requests_per_replica()
    assert _loop(topology.url) == _loop(server.url)
    after = topology.requests_per_replica()
    # Both replicas answered part of it: the loop really crossed processes.
    assert all(after[name] > before.get(name, 0) for name in after) and len(after) == 2, (before, after)


def test_another_accounts_run_is_refused_on_either_replica(topology):
    tc = _sc(topology.url).create_lora_training_client(base_model=TINY, rank=4).result()
    other = _key(topology.worker, "replicas-other")
    for replica in topology.replicas:
        def get_info(key: str) -> httpx.Response:
            return httpx.post(f"{replica.url}/api/v1/get_info", json={"model_id": tc.model_id},
                              headers={"X-API-Key": key}, timeout=60)

        assert get_info(API_KEY).status_code == 200
        refused = get_info(other)
        assert refused.status_code == 404 and refused.json()["category"] == "user", (replica.url, refused.text)


def test_one_seq_id_sent_to_both_replicas_runs_once(topology):
    tc = _sc(topology.url).create_lora_training_client(base_model=TINY, rank=4).result()
    body = {"model_id": tc.model_id, "seq_id": 1, "adam_params": {"learning_rate": 1e-3}}
    ids = [httpx.post(f"{r.url}/api/v1/optim_step", json=body, headers={"X-API-Key": API_KEY}, timeout=60)
           .json()["request_id"] for r in topology.replicas]
    assert ids[0] == ids[1]


@pytest.fixture(scope="module")
def reference(server) -> list[float]:
    """The faults' loop, uninterrupted, on the embedded SQLite server."""
    return _train(_sc(server.url).create_lora_training_client(base_model=TINY, rank=8, seed=5).result(), range(6))


def test_a_postgresql_restart_mid_loop_loses_nothing(reference, topology):
    tc = _sc(topology.url).create_lora_training_client(base_model=TINY, rank=8, seed=5).result()
    first = _train(tc, range(2))
    # Pipelined: the restart aborts every session (the replicas' pools and listeners, the driver's)
    # while ops are being sent, held in long-polls and stored; the SDK retries the 503s meanwhile.
    pending = []
    for step in range(2, 6):
        pending.append(tc.forward_backward(_batch(step), "cross_entropy"))
        last = tc.optim_step(ADAM)
        if step == 3:
            topology.cluster.restart()
    last.result()
    assert first + [fb.result().metrics["loss:sum"] for fb in pending] == reference
    # The restart reached the processes: each replica's and the driver's listener came back.
    for srv in [topology.worker, *topology.replicas]:
        assert any("listening on PostgreSQL again" in line for line in srv.lines), srv.lines[-20:]


def test_a_replica_killed_mid_loop_loses_nothing(reference, topology):
    # Last in the module: it kills replica 0 (and starts it again, for whatever runs after).
    tc = _sc(topology.url).create_lora_training_client(base_model=TINY, rank=8, seed=5).result()
    first = _train(tc, range(2))
    # Pipelined: the kill lands while ops are being sent and their long-polls are held on both replicas.
    pending, victim = [], topology.replicas[0]
    for step in range(2, 6):
        pending.append(tc.forward_backward(_batch(step), "cross_entropy"))
        last = tc.optim_step(ADAM)
        if step == 3:
            os.kill(victim.proc.pid, signal.SIGKILL)
            victim.proc.wait()
    last.result()
    rest = [fb.result().metrics["loss:sum"] for fb in pending]
    assert first + rest == reference
    # And a new loop goes on through the one replica left.
    assert len(_train(tc, range(6, 7))) == 1
    restarted = start_server(victim.data_dir, [TINY], topology.replica_args[0], env=topology.env)
    victim.proc, victim.lines = restarted.proc, restarted.lines
