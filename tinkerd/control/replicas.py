"""Wiring one process of the replicated topology (docs/deployment.md): `tinkerd serve --role api`
(stateless replicas behind a load balancer) and `--role worker` (the engine driver), sharing one
PostgreSQL. `--role all`, the embedded default, wires none of this.

What one process kept in memory and how replicas share it:
- long-poll wake-ups: the hub stays per process; results are announced with PostgreSQL NOTIFY and
  every replica's listener wakes its own waiters (store/listen.py);
- the queue, scheduler, quota windows, residency, recovery and retention: the driver's alone, the
  only process that runs ops; api replicas store ops unclaimed and the driver claims them
  (claims.py), so the quota windows see every account's ops whichever replica accepted them;
- idempotency of (model_id, seq_id), ownership, metering: rows of the shared database already
  (the unique dedupe_key decides a race between replicas);
- quota pauses: the driver posts why its scheduler holds an op back in the op's row, where a
  replica's retrieve_future reads it (pauses.py); the back-pressure budget counts the database's
  pending ops (backpressure.py);
- streamed tokens, unload_model and session ends: NOTIFY (store/listen.py);
- the served models: the driver's engine reports them; it writes them to `served_models`, where api
  replicas, which have no engine, read them at start and again whenever a driver announces new ones
  (a driver restarted with other --base-models) (store/served.py).
"""

from __future__ import annotations

import logging
import os
import socket
import time
import uuid
from typing import Callable

from tinkerd.control.store.db import Store
from tinkerd.control.store.served import ServedModelRepository
from tinkerd.errors import UserError
from tinkerd.types import ServedModel

log = logging.getLogger(__name__)

# How often an api replica that started before the driver looks for the driver's models.
_SERVED_POLL_S = 0.5


def check(role: str, store: Store) -> None:
    if role != "all" and store.sqlite:
        raise UserError(f"--role {role} shares the store with other processes: it needs --db-url "
                        f"postgresql+psycopg://... (SQLite is one process's; docs/deployment.md)")


def worker_id(role: str) -> str | None:
    """The driver's claim name: unique per process start, readable in the futures table."""
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}" if role == "worker" else None


def use_database_notifier(control, store: Store) -> None:
    """Wake-ups, work and cancels through PostgreSQL LISTEN/NOTIFY instead of this process alone."""
    from tinkerd.control.store.listen import PgNotifier

    driver = control.engine is not None
    control.use_notifier(PgNotifier(store, control.hub,
                                    on_work=control.claimer.wake if control.claimer is not None else None,
                                    on_cancel=control.cancel_id if driver else None,
                                    on_release=control.release_run if driver else None))


def follow_served(notifier, store: Store, use: Callable[[dict[str, ServedModel]], None]) -> None:
    """An api replica: `use(models)` whenever a driver announces its models (and after the listener
    reconnects): the app swaps in the new dict whole, so a request never sees one half-changed."""

    def refresh() -> None:
        models = {m.name: m for m in ServedModelRepository(store).all()}
        if models:  # empty: no driver has written any yet (a driver rewrites them in one transaction)
            use(models)
            log.info("serving the driver's models: %s", ", ".join(sorted(models)))

    notifier.on_served = refresh


def served_models(role: str, store: Store, client, worker: str | None, notifier=None) -> list[ServedModel]:
    """The models this process serves: its engine's (the driver writes them for the replicas and
    announces them through `notifier`), or, in an api replica, the driver's as written, waiting for a
    driver that has not started yet."""
    repo = ServedModelRepository(store)
    if role != "api":
        models = client.models()  # a process engine: waits here until its child is ready
        if role == "worker":
            repo.publish(models, worker)
            notifier.served()
        return models
    waited, t0 = 0.0, time.monotonic()
    while not (models := repo.all()):
        if time.monotonic() - t0 >= waited:
            log.warning("waiting for an engine driver (tinkerd serve --role worker) to publish its models")
            waited += 10.0
        time.sleep(_SERVED_POLL_S)
    return models
