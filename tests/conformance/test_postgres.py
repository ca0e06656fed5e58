"""tinkerd on PostgreSQL (`tinkerd serve --db-url postgresql+psycopg://...` on a real server,
tests/postgres.py) through the unmodified SDK. Beside these, test_ownership, test_metering and the
REST client test of test_checkpoints_rest run on both stores (`store_server`). Here: seeded samples
equal the SQLite server's bit for bit, the run-count quota holds, text PostgreSQL refuses is a user
error, and an SDK training loop whose server is killed (kill -9) mid pipelined loop recovers from
PostgreSQL with every loss equal to the same loop run uninterrupted on the SQLite server."""

from __future__ import annotations

import os
import signal

import httpx
import tinker
from tinker import types

from tests.conformance.conftest import TINY
from tests.conformance.test_quotas import _client, _key, _session, _until_done
from tests.conformance.test_retention import ADAM, _batch, _train
from tests.serverproc import API_KEY, start_server


def _sc(srv, key: str = API_KEY) -> tinker.ServiceClient:
    return tinker.ServiceClient(base_url=srv.url, api_key=key)


def test_seeded_samples_equal_the_sqlite_servers(server, pg_server):
    samples = {}
    for name, srv in (("sqlite", server), ("postgresql", pg_server)):
        sampler = _sc(srv).create_sampling_client(base_model=TINY).result()
        res = sampler.sample(types.ModelInput.from_ints([3, 1, 4, 1, 5]), 2,
                             types.SamplingParams(max_tokens=6, temperature=1.0, seed=3, stop=[])).result()
        samples[name] = [(s.tokens, s.logprobs) for s in res.sequences]
    assert samples["postgresql"] == samples["sqlite"]


def test_a_create_over_the_run_limit_waits_until_the_session_ends(pg_server):
    # The quota's count of live runs is a query on the store (control/quotas.py), run here on PostgreSQL.
    key = _key(pg_server, "pg-one-run", "--max-concurrent-runs", "1")
    sc = _sc(pg_server, key)
    sc.create_lora_training_client(base_model=TINY, rank=4).result()  # 1 of 1
    c = _client(pg_server, key)
    r = c.post("/create_model", json={"session_id": _session(c), "model_seq_id": 0, "base_model": TINY,
                                      "lora_config": {"rank": 4}})
    pending = r.json()["request_id"]
    body = c.post("/retrieve_future", json={"request_id": pending}).json()
    assert body.get("queue_state") == "paused_rate_limit" and "1 of 1 concurrent training runs" in body["queue_state_reason"]
    sc.close("success").result()
    assert _until_done(c, pending).json()["type"] == "create_model"


def test_text_postgresql_refuses_is_a_user_error_not_a_5xx(pg_server):
    # PostgreSQL text cannot hold NUL, which SQLite stores: looked up or stored, it is the caller's 400.
    h = {"X-API-Key": API_KEY}
    r = httpx.post(f"{pg_server.url}/api/v1/retrieve_future", json={"request_id": "a\u0000b"}, headers=h, timeout=60)
    assert r.status_code == 400 and r.json()["category"] == "user" and "NUL" in r.json()["error"], r.text
    r = httpx.post(f"{pg_server.url}/api/v1/create_session", headers=h, timeout=60,
                   json={"tags": [], "user_metadata": {}, "sdk_version": "0.38.0", "display_name": "a\u0000b"})
    assert r.status_code == 400 and r.json()["category"] == "user" and "NUL" in r.json()["error"], r.text


def test_a_kill_9_mid_loop_recovers_the_run_exactly_and_equals_the_sqlite_servers_run(server, pg_server):
    # Last in this module: it replaces pg_server's process (same port, same database) in place. The
    # reference is the same loop, uninterrupted, on the SQLite server: the stores must not change a bit.
    reference = _train(_sc(server).create_lora_training_client(base_model=TINY, rank=8, seed=5).result(), range(4))
    tc = _sc(pg_server).create_lora_training_client(base_model=TINY, rank=8, seed=5).result()
    first = _train(tc, range(2))
    fb = tc.forward_backward(_batch(2), "cross_entropy")  # accepted, perhaps not run, when the kill lands
    step = tc.optim_step(ADAM)
    os.kill(pg_server.proc.pid, signal.SIGKILL)
    pg_server.proc.wait()
    new = start_server(pg_server.data_dir, [TINY], pg_server.args, env=pg_server.env)
    pg_server.proc, pg_server.lines = new.proc, new.lines
    step.result()
    rest = [fb.result().metrics["loss:sum"]] + _train(tc, range(3, 4))
    assert first + rest == reference
