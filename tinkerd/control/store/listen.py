"""PostgreSQL LISTEN/NOTIFY behind the notifier seam (control/notify.py), for replicas sharing one
database (docs/deployment.md).

Three channels: `tinkerd_done` (payload "<request_id> <target>": an op's outcome is stored),
`tinkerd_work` (an api replica stored ops for the engine driver to claim) and `tinkerd_cancel`
(payload: a request_id to stop). NOTIFY is sent on a pooled connection of the store's engine in its
own transaction, after the row it announces has committed, so a woken reader always finds the row.

Each process listens on one psycopg connection of its own, on a daemon thread. A connection lost
(PostgreSQL restarted or unreachable) is reconnected with back-off, 0.1 s doubling to 2 s; any
notification sent meanwhile is lost, so on reconnecting every waiter of the hub is woken to read the
store again and the driver is told to look for work (`on_work`): a missed wake-up costs one extra
read, never a lost result.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable

import psycopg
from sqlalchemy import make_url, text

from tinkerd.control.futures import FutureHub
from tinkerd.control.store.db import Store

log = logging.getLogger(__name__)

DONE, WORK, CANCEL = "tinkerd_done", "tinkerd_work", "tinkerd_cancel"
# conn.notifies() returns at least this often, so `close` ends the thread within about this long.
_POLL_S = 0.5


class PgNotifier:
    def __init__(self, store: Store, hub: FutureHub, on_work: Callable[[], None] | None = None,
                 on_cancel: Callable[[str], None] | None = None):
        self.store = store
        self.hub = hub
        # Only the engine driver passes these; an api replica listens for results alone.
        self.on_work = on_work
        self.on_cancel = on_cancel
        url = make_url(str(store.engine.url.render_as_string(hide_password=False)))
        self._dsn = url.set(drivername="postgresql").render_as_string(hide_password=False)
        self._stop = threading.Event()
        self._listening = threading.Event()
        self._thread: threading.Thread | None = None
        # Connections made by the listener (1 at start, +1 per reconnect): the tests' evidence that it
        # came back after a PostgreSQL restart.
        self.connects = 0

    # -- sending (any thread) ----------------------------------------------------------------------

    def notify(self, request_id: str, target: str | None = None) -> None:
        self.hub.notify(request_id, target)  # this process's waiters at once, without a round trip
        self._send(DONE, f"{request_id} {target or ''}")

    def work(self) -> None:
        self._send(WORK, "")

    def cancel(self, request_id: str) -> None:
        self._send(CANCEL, request_id)

    def _send(self, channel: str, payload: str) -> None:
        try:
            with self.store.engine.connect() as conn:
                conn.execute(text("SELECT pg_notify(:channel, :payload)"), {"channel": channel, "payload": payload})
                conn.commit()
        except Exception as e:  # noqa: BLE001  the row is stored: a lost hint only delays a reader (see above)
            log.warning("could not send a %s notification: %s", channel, e)

    # -- listening ---------------------------------------------------------------------------------

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="tinkerd-listen", daemon=True)
        self._thread.start()
        # A process that answers before its listener is up could miss a wake-up it is waiting for.
        self._listening.wait(timeout=30)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def _run(self) -> None:
        delay = 0.1
        while not self._stop.is_set():
            try:
                with psycopg.connect(self._dsn, autocommit=True) as conn:
                    channels = [DONE] + ([WORK] if self.on_work else []) + ([CANCEL] if self.on_cancel else [])
                    for channel in channels:
                        conn.execute(f"LISTEN {channel}")
                    self.connects += 1
                    if self.connects > 1:
                        log.warning("listening on PostgreSQL again; waking every waiter to read the store")
                        self._caught_up()
                    self._listening.set()
                    delay = 0.1
                    while not self._stop.is_set():
                        for n in conn.notifies(timeout=_POLL_S):
                            self._dispatch(n.channel, n.payload)
            except psycopg.Error as e:
                if self._stop.is_set():
                    return
                log.warning("PostgreSQL listener lost its connection (%s); reconnecting in %.1f s",
                            str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__, delay)
                time.sleep(delay)
                delay = min(delay * 2, 2.0)

    def _caught_up(self) -> None:
        self.hub.wake_all()
        if self.on_work is not None:
            self.on_work()

    def _dispatch(self, channel: str, payload: str) -> None:
        try:
            if channel == DONE:
                request_id, _, target = payload.partition(" ")
                self.hub.notify(request_id, target or None)
            elif channel == WORK and self.on_work is not None:
                self.on_work()
            elif channel == CANCEL and self.on_cancel is not None:
                self.on_cancel(payload)
        except Exception:  # noqa: BLE001  one bad notification must not end the listener
            log.exception("handling %s %r failed", channel, payload)
