"""The API's event loop never waits on a blocking call (issue 18, item 4): while one request sits in
a slow store call (here a checkpoint listing held on an Event, standing in for a listing of
thousands of rows or a delete of a big checkpoint), another client's cheap requests, a
retrieve_future long-poll among them, are answered. No timing is asserted: the order is. Before
the routes ran their store calls on the loop, the second request could not even be read until the
first returned, and this test failed on the bounded wait for it.

A real uvicorn on a real socket, with a real Control and SQLite store; only the engine is a fake
(nothing here reaches it)."""

from __future__ import annotations

import socket
import threading

import httpx
import pytest
import uvicorn

from tinkerd.api.app import create_app
from tinkerd.api.deps import AppState
from tinkerd.config import ServerConfig
from tinkerd.control.accounts import Accounts
from tinkerd.control.control import Control
from tinkerd.control.runs import Runs
from tinkerd.control.store.db import Store, utcnow
from tinkerd.control.store.tables import FutureRow

KEY = "tml-event-loop-test"
BOUND_S = 30  # a deadlock guard only: the answer comes in milliseconds when the loop is free


class IdleEngine:
    def models(self):
        return []

    def close(self):
        pass


@pytest.fixture
def live(tmp_path):
    store = Store.sqlite(tmp_path / "db.sqlite")
    runs = Runs(store, tmp_path / "checkpoints")
    control = Control(store, IdleEngine(), runs=runs)
    accounts = Accounts(store)
    accounts.create_key("test", key=KEY)
    config = ServerConfig(data_dir=tmp_path, base_models=[], retrieve_future_timeout_s=1.0)
    app = create_app(AppState(config=config, control=control, runs=runs, served={}, accounts=accounts))
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    with httpx.Client(base_url=url, headers={"X-API-Key": KEY}, timeout=BOUND_S) as c:
        for _ in range(600):  # until uvicorn listens
            try:
                c.get("/api/v1/healthz")
                break
            except httpx.TransportError:
                threading.Event().wait(0.05)
    yield url, store, runs, accounts.verify(KEY)
    server.should_exit = True
    thread.join(timeout=10)
    sock.close()


def test_a_request_held_in_a_slow_store_call_does_not_hold_another_clients_requests(live, monkeypatch):
    url, store, runs, account_id = live
    session_id = runs.sessions.create_session([], {}, None, account_id=account_id)
    run, _ = runs.training_runs.create_run(session_id, 0, "m", {"rank": 1}, None, account_id=account_id)
    now = utcnow()
    store.add(FutureRow(request_id="req-done", request_type="OptimStep", target=run.model_id, account_id=account_id,
                        body=b"", status="complete", result=b'{"metrics": {}}', result_media_type="application/json",
                        created_at=now, completed_at=now))

    entered, release = threading.Event(), threading.Event()
    listing = runs.checkpoints.list_checkpoints

    def slow_listing(*args, **kwargs):
        entered.set()
        release.wait(BOUND_S)
        return listing(*args, **kwargs)

    monkeypatch.setattr(runs.checkpoints, "list_checkpoints", slow_listing)
    slow: dict = {}

    def list_checkpoints():
        with httpx.Client(base_url=url, headers={"X-API-Key": KEY}, timeout=BOUND_S * 2) as c:
            slow["response"] = c.get(f"/api/v1/training_runs/{run.model_id}/checkpoints")

    t = threading.Thread(target=list_checkpoints)
    t.start()
    try:
        assert entered.wait(BOUND_S), "the listing never reached the store"
        with httpx.Client(base_url=url, headers={"X-API-Key": KEY}, timeout=BOUND_S) as c:
            done = c.post("/api/v1/retrieve_future", json={"request_id": "req-done"})
            # A pending future's long poll: held for the hold time, then a 408 try_again.
            run_info = c.get(f"/api/v1/training_runs/{run.model_id}")
        assert not release.is_set() and "response" not in slow  # the listing is still in its store call
        assert done.status_code == 200 and done.json() == {"metrics": {}}
        assert run_info.status_code == 200 and run_info.json()["training_run_id"] == run.model_id
    finally:
        release.set()
        t.join(BOUND_S)
    assert slow["response"].status_code == 200 and slow["response"].json()["checkpoints"] == []


def test_the_loops_lag_is_a_histogram_on_metrics(live):
    url = live[0]

    def count() -> float:
        page = httpx.get(f"{url}/metrics", timeout=BOUND_S).text
        return next(float(line.split()[-1]) for line in page.splitlines()
                    if line.startswith("tinkerd_event_loop_lag_seconds_count"))

    first = count()
    for _ in range(200):  # the probe wakes every 50 ms: wait for its next sample, boundedly
        if count() > first:
            break
        threading.Event().wait(0.05)
    assert count() > first
