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
