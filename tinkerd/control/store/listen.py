"""PostgreSQL LISTEN/NOTIFY behind the notifier seam (control/notify.py), for replicas sharing one
database (docs/deployment.md).

Channels, the driver's to the replicas:
- `tinkerd_done` (payload "<request_id> <target>"): an op's outcome is stored;
- `tinkerd_tokens` (payload "<request_id> <JSON tokens>"): a streaming request's new tokens, as the
  engine decodes them (OpenAI `stream: true` on a replica, api/openai_stream.py). Through NOTIFY
  rather than a replica polling the store: the tokens exist nowhere else until the request ends,
  and a replica's stream should send them as the embedded server's does, not all at the end. One
  notification per request per decode step (a round trip on the driver's worker, ~1 ms), split to
  stay under PostgreSQL's 8000-byte payload limit; sent only while such requests decode;
- `tinkerd_served`: the driver rewrote `served_models` (it started, maybe with other models);
the replicas' to the driver:
- `tinkerd_work`: ops were stored for the driver to claim;
- `tinkerd_cancel` (payload: a request_id): stop a sample;
- `tinkerd_release` (payload: a model_id, or empty): release a run's adapter (hpcai unload_model),
  or look for runs to release now (a session ended).
NOTIFY is sent on a pooled connection of the store's engine in its own transaction, after the row it
announces has committed, so a woken reader always finds the row; notifications one process sends
arrive in the order it sent them, so a stream's last tokens arrive before its `done`.

Each process listens on one psycopg connection of its own, on a daemon thread. A connection lost
(PostgreSQL restarted or unreachable) is reconnected with back-off, 0.1 s doubling to 2 s; any
notification sent meanwhile is lost, so on reconnecting every waiter of the hub is woken to read the
store again, every stream finishes from the stored result (tokens sent meanwhile are lost), the
driver is told to look for work (`on_work`) and releases the runs whose unload_model it may have
missed (the UnloadModel futures stored since the connection was lost), and a replica reads the
served models again: a missed notification costs an extra read, never a lost result.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from datetime import timedelta
from typing import Callable

import numpy as np
import psycopg
from sqlalchemy import make_url, text

from tinkerd.control.futures import FutureHub
from tinkerd.control.store.db import Store, utcnow
from tinkerd.control.store.futures import FutureRepository
from tinkerd.types import TokenDelta

log = logging.getLogger(__name__)

DONE, TOKENS, SERVED = "tinkerd_done", "tinkerd_tokens", "tinkerd_served"
WORK, CANCEL, RELEASE = "tinkerd_work", "tinkerd_cancel", "tinkerd_release"
# conn.notifies() returns at least this often, so `close` ends the thread within about this long.
_POLL_S = 0.5
# Below PostgreSQL's 8000-byte NOTIFY payload limit, with room for the request_id.
_PAYLOAD_BYTES = 7000
# How far before a lost connection a caught-up driver looks for unload requests it may have missed.
_CATCH_UP_MARGIN = timedelta(seconds=5)


class PgNotifier:
    def __init__(self, store: Store, hub: FutureHub, on_work: Callable[[], None] | None = None,
                 on_cancel: Callable[[str], None] | None = None,
                 on_release: Callable[[str | None], None] | None = None,
                 on_served: Callable[[], None] | None = None):
        self.store = store
        self.hub = hub
        # Only the engine driver passes these three; an api replica listens for results, tokens and
        # served models (on_served: read them again) instead.
        self.on_work = on_work
        self.on_cancel = on_cancel
        self.on_release = on_release
        self.on_served = on_served
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

    def publish(self, request_id: str, deltas: list[TokenDelta]) -> None:
        self.hub.publish(request_id, deltas)  # a reader on the driver itself
        self._send(TOKENS, *token_payloads(request_id, deltas))

    def work(self) -> None:
        self._send(WORK, "")

    def cancel(self, request_id: str) -> None:
        self._send(CANCEL, request_id)

    def release(self, model_id: str | None) -> None:
        self._send(RELEASE, model_id or "")

    def served(self) -> None:
        self._send(SERVED, "")

    def _send(self, channel: str, *payloads: str) -> None:
        try:
            with self.store.engine.connect() as conn:
                for payload in payloads:
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

    def _channels(self) -> list[str]:
        callbacks = ((WORK, self.on_work), (CANCEL, self.on_cancel), (RELEASE, self.on_release), (SERVED, self.on_served))
        channels = [DONE] + [channel for channel, callback in callbacks if callback is not None]
        if self.on_work is None:  # an api replica: the driver hands tokens to its own readers directly
            channels.append(TOKENS)
        return channels

    def _run(self) -> None:
        delay = 0.1
        lost_at = None
        while not self._stop.is_set():
            try:
                with psycopg.connect(self._dsn, autocommit=True) as conn:
                    for channel in self._channels():
                        conn.execute(f"LISTEN {channel}")
                    self.connects += 1
                    if self.connects > 1:
                        log.warning("listening on PostgreSQL again; waking every waiter to read the store")
                        self._caught_up(lost_at)
                    self._listening.set()
                    delay, lost_at = 0.1, None
                    while not self._stop.is_set():
                        for n in conn.notifies(timeout=_POLL_S):
                            self._dispatch(n.channel, n.payload)
            except psycopg.Error as e:
                if self._stop.is_set():
                    return
                lost_at = lost_at or utcnow()
                log.warning("PostgreSQL listener lost its connection (%s); reconnecting in %.1f s",
                            str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__, delay)
                time.sleep(delay)
                delay = min(delay * 2, 2.0)

    def _caught_up(self, lost_at) -> None:
        self.hub.wake_all()
        if self.on_work is not None:
            self.on_work()
        if self.on_release is not None:
            since = (lost_at or utcnow()) - _CATCH_UP_MARGIN
            for model_id in FutureRepository(self.store).unloaded_since(since):
                self.on_release(model_id)
            self.on_release(None)
        if self.on_served is not None:
            self.on_served()

    def _dispatch(self, channel: str, payload: str) -> None:
        try:
            if channel == DONE:
                request_id, _, target = payload.partition(" ")
                self.hub.notify(request_id, target or None)
            elif channel == WORK and self.on_work is not None:
                self.on_work()
            elif channel == TOKENS:
                request_id, deltas = read_tokens(payload)
                self.hub.publish(request_id, deltas)
            elif channel == CANCEL and self.on_cancel is not None:
                self.on_cancel(payload)
            elif channel == RELEASE and self.on_release is not None:
                self.on_release(payload or None)
            elif channel == SERVED and self.on_served is not None:
                self.on_served()
        except Exception:  # noqa: BLE001  one bad notification must not end the listener
            log.exception("handling %s %r failed", channel, payload)


def token_payloads(request_id: str, deltas: list[TokenDelta]) -> list[str]:
    """`tinkerd_tokens` payloads: "<request_id> <JSON list>", one item per token
    ([row, position, token, logprob, [top-k ids, top-k logprobs] or null]), as many per payload as
    fit the limit. JSON floats round-trip exactly (Python writes the shortest repr that reads back)."""
    items = []
    for d in deltas:
        for k, token in enumerate(d.tokens):
            topk = None if d.topk is None else [d.topk[0][k].tolist(), d.topk[1][k].tolist()]
            items.append(json.dumps([d.row, d.start + k, int(token), float(d.logprobs[k]), topk]))
    payloads, batch, size = [], [], 0
    for item in items:
        if batch and size + len(item) + 1 > _PAYLOAD_BYTES:
            payloads.append(f"{request_id} [{','.join(batch)}]")
            batch, size = [], 0
        batch.append(item)
        size += len(item) + 1
    if batch:
        payloads.append(f"{request_id} [{','.join(batch)}]")
    return payloads


def read_tokens(payload: str) -> tuple[str, list[TokenDelta]]:
    """A `tinkerd_tokens` payload back as the request's deltas, one token each."""
    request_id, _, items = payload.partition(" ")
    return request_id, [TokenDelta(row, start, [token], [logprob],
                                   None if topk is None else (np.asarray([topk[0]]), np.asarray([topk[1]])))
                        for row, start, token, logprob, topk in json.loads(items)]
