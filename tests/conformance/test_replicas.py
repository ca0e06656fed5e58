"""Stateless API replicas (docs/deployment.md): two `tinkerd serve --role api` processes behind a
real HAProxy, one `--role worker` driving the engine, all on one real PostgreSQL, through the
unmodified SDK. Losses, samples and checkpoints equal the embedded SQLite server's (`server`) bit for
bit; ownership and (model_id, seq_id) idempotency hold whichever replica a request lands on; and a
pipelined training loop through the load balancer outlives a kill -9 of one replica with every loss
equal to the uninterrupted run. The session's one topology (conftest.py: replicas_server; a start
is ~4 processes), which test_ownership, test_metering, test_checkpoints_rest and test_quotas run
through too."""

from __future__ import annotations

import os
import signal
import time

import httpx
import pytest
import tinker
from tinker import types

from tests.conformance.conftest import TINY
from tests.conformance.test_quotas import _key
from tests.conformance.test_retention import ADAM, _batch, _train
from tests.serverproc import API_KEY, start_server


@pytest.fixture(scope="module")
def topology(replicas_server):
    return replicas_server


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


def test_a_replica_refuses_ops_over_the_queue_budget_that_the_driver_holds(topology):
    """--max-queued-ops-per-model 8 (tests/replicas.py): with 8 of a sampling session's requests
    waiting in the driver (held by its account's quota), a 9th is answered 429 QueueFull by either
    replica, whose own queue is empty: the budget counts the database's pending ops. Lifting the
    quota runs all 8, and the 9th is then accepted."""
    from tests.conformance.test_quotas import _client, _session, _tinkerd, _until_done

    key = _key(topology, "replicas-budget", "--max-tokens-per-minute", "40")
    lb = _client(topology, key)
    r = lb.post("/create_sampling_session", json={"session_id": _session(lb), "sampling_session_seq_id": 0,
                                                   "base_model": TINY})
    sampler = r.json()["sampling_session_id"]

    def asample(c, seq_id: int) -> httpx.Response:
        # 20 prompt tokens + at most 8 sampled = 28: the first fills the account's 40 a minute, and
        # every later one waits behind it for the minute.
        return c.post("/asample", json={
            "sampling_session_id": sampler, "seq_id": seq_id, "num_samples": 1,
            "prompt": {"chunks": [{"type": "encoded_text", "tokens": list(range(1, 21))}]},
            "sampling_params": {"max_tokens": 8, "stop": []}})

    _until_done(lb, asample(lb, 1).json()["request_id"])
    held = []
    for seq_id in range(2, 10):
        r = asample(lb, seq_id)
        assert r.status_code == 200, r.text
        held.append(r.json()["request_id"])
    for url in topology.doors:  # each replica, its own queue empty, counts the 8 the driver holds
        refused = asample(_client(topology, key, url), 10)
        assert refused.status_code == 429 and refused.json()["category"] == "server", (url, refused.text)
        assert "8 ops waiting" in refused.json()["error"] and refused.headers["retry-after"]
    lifted = _tinkerd(topology.data_dir, "accounts", "set-quota", "replicas-budget", "--max-tokens-per-minute",
                      "unlimited", env=topology.cli_env())
    assert lifted.returncode == 0, lifted.stderr
    for request_id in held:
        _until_done(lb, request_id)
    assert asample(lb, 10).status_code == 200


def test_unload_model_on_a_replica_releases_the_run_in_the_driver(topology):
    """hpcai's unload_model sent to a replica (which has no engine) reaches the driver's residency
    (NOTIFY tinkerd_release): the run leaves the engine, and its next op rebuilds it exactly."""
    tc = _sc(topology.url).create_lora_training_client(base_model=TINY, rank=4, seed=2).result()
    before = tc.forward_backward(_batch(0), "cross_entropy").result().metrics["loss:sum"]
    r = httpx.post(f"{topology.doors[0]}/api/v1/unload_model", json={"model_id": tc.model_id},
                   headers={"X-API-Key": API_KEY}, timeout=60)
    assert r.status_code == 200, r.text
    deadline = time.monotonic() + 60  # the release runs in its turn on the driver's worker
    while tc.model_id not in httpx.get(f"{topology.url}/api/v1/engine_status", headers={"X-API-Key": API_KEY},
                                       timeout=30).json()["released_model_ids"]:
        assert time.monotonic() < deadline, "unload_model on a replica did not release the run"
        time.sleep(0.5)
    # No optim_step between: the rebuilt run gives the same loss for the same batch.
    assert tc.forward_backward(_batch(0), "cross_entropy").result().metrics["loss:sum"] == before


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

