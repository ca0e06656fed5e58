"""The notifier seam on a real PostgreSQL (control/store/listen.py) and the driver's claims
(store/futures.py: FutureRepository.claim). Two Store instances on one database stand for two
processes: a wake-up crosses only through LISTEN/NOTIFY, never through shared memory."""

from __future__ import annotations

import asyncio
import threading
import uuid
from concurrent.futures import ThreadPoolExecutor

import psycopg
import pytest
from sqlalchemy import select

from tinkerd.control.futures import FutureHub
from tinkerd.control.store.db import Store, utcnow
from tinkerd.control.store.futures import FutureRepository
from tinkerd.control.store.listen import PgNotifier
from tinkerd.control.store.tables import FutureRow

# Long enough that a wait ending by timeout, not by the notification, cannot be mistaken for a pass:
# every wait below must end because it was woken (the waits' is_done is always False).
HOLD_S = 30.0


@pytest.fixture
def pg_db(pg_server_url):
    from tests.postgres import fresh_database

    return fresh_database(pg_server_url)


@pytest.fixture
def processes(pg_db):
    """(sender's store, listener's store): one database, two engines and pools."""
    a, b = Store(pg_db), Store(pg_db)
    yield a, b
    a.engine.dispose()
    b.engine.dispose()


def _listener(store: Store, hub: FutureHub, **callbacks) -> PgNotifier:
    n = PgNotifier(store, hub, **callbacks)
    n.start()
    return n


def test_a_result_announced_by_one_process_wakes_the_waiters_of_another(processes):
    sender_store, listener_store = processes
    sender = PgNotifier(sender_store, FutureHub())

    async def main() -> list[bool]:
        hub = FutureHub()
        hub.bind_loop(asyncio.get_running_loop())
        listener = await asyncio.to_thread(_listener, listener_store, hub)
        try:
            waits = [asyncio.create_task(hub.wait(key, HOLD_S, lambda: False)) for key in ("req-1", "target:sess-1")]
            await asyncio.sleep(0)  # both registered before the notification is sent
            await asyncio.to_thread(sender.notify, "req-1", "sess-1")
            return list(await asyncio.gather(*waits))
        finally:
            await asyncio.to_thread(listener.close)

    assert asyncio.run(main()) == [True, True]


def test_work_and_cancels_reach_the_driver(processes):
    sender_store, listener_store = processes
    work, cancelled = threading.Event(), []
    got_cancel = threading.Event()
    listener = _listener(listener_store, FutureHub(), on_work=work.set,
                         on_cancel=lambda rid: (cancelled.append(rid), got_cancel.set()))
    try:
        sender = PgNotifier(sender_store, FutureHub())
        sender.work()
        sender.cancel("req-9")
        assert work.wait(HOLD_S) and got_cancel.wait(HOLD_S)
        assert cancelled == ["req-9"]
    finally:
        listener.close()


def test_a_listener_whose_connection_dies_reconnects_and_wakes_every_waiter(processes, pg_db):
    # What a PostgreSQL restart does to the listener: its connection is gone, and notifications sent
    # meanwhile are lost. After reconnecting it wakes every waiter (to read the store again) and
    # tells the driver to look for work; later notifications arrive again.
    sender_store, listener_store = processes
    work = threading.Event()

    async def main() -> tuple[bool, bool]:
        hub = FutureHub()
        hub.bind_loop(asyncio.get_running_loop())
        listener = await asyncio.to_thread(_listener, listener_store, hub, on_work=work.set)
        try:
            missed = asyncio.create_task(hub.wait("req-lost", HOLD_S, lambda: False))
            await asyncio.sleep(0)
            await asyncio.to_thread(_terminate_listeners, pg_db)
            woken = await missed
            later = asyncio.create_task(hub.wait("req-2", HOLD_S, lambda: False))
            await asyncio.sleep(0)
            await asyncio.to_thread(PgNotifier(sender_store, FutureHub()).notify, "req-2")
            return woken, await later
        finally:
            assert listener.connects >= 2
            await asyncio.to_thread(listener.close)

    assert asyncio.run(main()) == (True, True)
    assert work.is_set()


def _terminate_listeners(url: str) -> None:
    dsn = url.replace("postgresql+psycopg://", "postgresql://", 1)
    with psycopg.connect(dsn, autocommit=True) as conn:
        killed = conn.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                              "WHERE query LIKE 'LISTEN%' AND datname = current_database()").fetchall()
    assert killed, "no listening connection found"


def test_concurrent_claims_take_each_pending_op_exactly_once(processes):
    store = processes[0]
    ids = [f"req-{uuid.uuid4().hex}" for _ in range(60)]
    for i, rid in enumerate(ids):
        store.add(FutureRow(request_id=rid, request_type="OptimStep", target="m", seq_id=i, body=b"", status="pending",
                            created_at=utcnow()))
    store.add(FutureRow(request_id="req-done", request_type="OptimStep", target="m", body=b"", status="complete",
                        created_at=utcnow()))
    # Four drivers over two stores (two pools), small batches so that their transactions overlap.
    repos = [FutureRepository(s) for s in processes] * 2

    def drain(i: int) -> list[str]:
        taken = []
        while rows := repos[i].claim(f"w{i}", limit=3):
            taken += [r.request_id for r in rows]
        return taken

    with ThreadPoolExecutor(4) as pool:
        claims = list(pool.map(drain, range(4)))
    flat = [rid for c in claims for rid in c]
    assert sorted(flat) == sorted(ids)  # every pending op once; the finished one never
    owners = dict(store.rows(select(FutureRow.request_id, FutureRow.claimed_by)))
    assert all(owners[rid] == f"w{i}" for i, c in enumerate(claims) for rid in c)
    # A driver's start takes every pending op, whoever claimed it (a previous driver, now gone).
    assert FutureRepository(store).claim_all_pending("w-new") == 60
    assert FutureRepository(store).claim("w-other") == []


def test_a_streams_tokens_cross_to_another_process_exactly_and_in_order(processes):
    """The driver's decoded tokens reach a replica's stream reader (store/listen.py: tinkerd_tokens):
    every token, logprob and top-k entry equal to what was published, in order, before the
    request's end; a step's deltas too big for one NOTIFY payload arrive split, none lost."""
    import numpy as np

    from tinkerd.types import TokenDelta

    sender_store, listener_store = processes
    topk = (np.arange(6, dtype=np.int64).reshape(2, 3), -np.linspace(0.1, 0.6, 6, dtype=np.float32).reshape(2, 3))
    steps = [[TokenDelta(0, 0, [11, 12], [-0.25, -1.0 / 3], topk), TokenDelta(1, 0, [21, 22], [-0.5, -2.0], topk)],
             # 2000 tokens in one step: far over the 8000-byte payload limit.
             [TokenDelta(0, 2, list(range(2000)), [-i / 7 for i in range(2000)])]]
    driver = PgNotifier(sender_store, FutureHub(), on_work=lambda: None)  # a driver does not listen for tokens

    async def main() -> list:
        hub = FutureHub()
        hub.bind_loop(asyncio.get_running_loop())
        listener = await asyncio.to_thread(_listener, listener_store, hub)
        try:
            queue: asyncio.Queue = asyncio.Queue()
            hub.subscribe("req-s", queue)
            for deltas in steps:
                await asyncio.to_thread(driver.publish, "req-s", deltas)
            await asyncio.to_thread(driver.notify, "req-s")
            got = []
            while (item := await asyncio.wait_for(queue.get(), HOLD_S))[1] is not None:
                got += item[1]
            return got
        finally:
            await asyncio.to_thread(listener.close)

    got = asyncio.run(main())
    sent = [(d.row, d.start + k, t, d.logprobs[k], None if d.topk is None else (d.topk[0][k].tolist(), d.topk[1][k].tolist()))
            for deltas in steps for d in deltas for k, t in enumerate(d.tokens)]
    assert [(d.row, d.start, d.tokens[0], d.logprobs[0],
             None if d.topk is None else (d.topk[0][0].tolist(), d.topk[1][0].tolist())) for d in got] == sent


def test_a_replicas_unload_and_session_end_reach_the_driver_and_new_models_the_replicas(processes):
    sender_store, listener_store = processes
    released, served = [], threading.Event()
    got_all = threading.Event()

    def on_release(model_id):
        released.append(model_id)
        if len(released) == 2:
            got_all.set()

    driver = _listener(listener_store, FutureHub(), on_work=lambda: None, on_release=on_release)
    replica = PgNotifier(sender_store, FutureHub(), on_served=served.set)
    replica.start()
    try:
        replica.release("m-1")
        replica.release(None)
        assert got_all.wait(HOLD_S) and released == ["m-1", None]
        PgNotifier(listener_store, FutureHub()).served()  # a driver (re)started and rewrote served_models
        assert served.wait(HOLD_S)
    finally:
        driver.close()
        replica.close()


def test_a_driver_that_was_away_releases_the_runs_unloaded_meanwhile(processes, pg_db):
    """Notifications sent while the listener reconnects are lost; the unload_model futures stored
    are not: once back, the driver releases the runs of those stored since shortly before it lost
    its connection, and looks for ended sessions."""
    sender_store, listener_store = processes
    released, caught_up = [], threading.Event()

    def on_release(model_id):
        released.append(model_id)
        if model_id is None:
            caught_up.set()

    driver = _listener(listener_store, FutureHub(), on_work=lambda: None, on_release=on_release)
    try:
        sender_store.add(FutureRow(request_id="req-u", request_type="UnloadModel", target="m-away", body=b"",
                                   status="complete", created_at=utcnow()))
        _terminate_listeners(pg_db)
        assert caught_up.wait(HOLD_S)
        assert released == ["m-away", None]
    finally:
        driver.close()


def test_a_replica_serves_the_models_a_restarted_driver_announces(processes):
    """A driver restarted with other --base-models rewrites served_models and says so (tinkerd_served):
    a running replica swaps in the new list, without a restart of its own (control/replicas.py)."""
    from tinkerd.control import replicas
    from tinkerd.types import ServedModel

    driver_store, replica_store = processes

    class Engine:  # what the driver's engine reports it serves
        def __init__(self, names):
            self.names = names

        def models(self):
            return [ServedModel(n, n, 128, "qwen3") for n in self.names]

    seen, changed = [], threading.Event()
    replica = PgNotifier(replica_store, FutureHub())
    replicas.follow_served(replica, replica_store, lambda models: (seen.append(sorted(models)), changed.set()))
    replica.start()
    try:
        for names in (["m-a"], ["m-a", "m-b"]):  # a start, then a restart with one more model
            changed.clear()
            replicas.served_models("worker", driver_store, Engine(names), "w1", PgNotifier(driver_store, FutureHub()))
            assert changed.wait(HOLD_S)
        assert seen == [["m-a"], ["m-a", "m-b"]]
    finally:
        replica.close()
