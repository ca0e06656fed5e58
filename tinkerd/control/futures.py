"""Wake long-polling retrieve_future calls when their result lands.

Results are written by the engine worker thread; pollers wait on asyncio events in the server's
event loop. The hub bridges the two with call_soon_threadsafe, so a poller wakes within a loop
tick of completion instead of polling the store.

A streaming reader (OpenAI's `stream: true`) subscribes a queue to its request: it gets each step's
new tokens as the worker publishes them, then `None` once the result is stored.
"""

from __future__ import annotations

import asyncio
import inspect
import threading


class FutureHub:
    def __init__(self) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        self._events: dict[str, asyncio.Event] = {}
        self._lock = threading.Lock()
        # request_id -> the reader's queue; touched on the loop only (delivery is scheduled there).
        self._streams: dict[str, asyncio.Queue] = {}

    def bind_loop(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop

    async def wait(self, request_id: str, timeout_s: float, is_done) -> bool:
        """Wait until `is_done()` or the timeout. Must run on the bound loop. `is_done` may return an
        awaitable (a store read sent to the thread pool, which keeps it off the loop)."""
        with self._lock:
            event = self._events.get(request_id)
            if event is None:
                event = self._events[request_id] = asyncio.Event()
        # Checked after registering: a completion between the caller's check and now still wakes us.
        if await _value(is_done()):
            return True
        try:
            await asyncio.wait_for(event.wait(), timeout_s)
            return True
        except asyncio.TimeoutError:
            return await _value(is_done())

    def wake_all(self) -> None:
        """Wake every waiter to read the store again: wake-ups may have been missed (a notifier that
        reconnected, control/store/listen.py). A waiter whose op is still pending answers try_again;
        a stream's reader, which may have missed tokens too, finishes from the stored result (its
        `None` is the end of the live tokens; api/openai_stream.py then waits for the result)."""
        with self._lock:
            events, self._events = list(self._events.values()), {}
        if self._loop is None:
            return
        for event in events:
            self._loop.call_soon_threadsafe(event.set)
        self._loop.call_soon_threadsafe(self._end_streams)

    def _end_streams(self) -> None:
        for request_id in list(self._streams):
            self._deliver(request_id, None)

    def subscribe(self, request_id: str, queue: asyncio.Queue) -> None:
        """Put (request_id, item) on `queue` for every publish, then (request_id, None) when the result
        is stored. Must run on the bound loop, in the same tick as the submit that made request_id:
        deliveries are scheduled on the loop, so none can run before this does."""
        self._streams[request_id] = queue

    def unsubscribe(self, request_id: str) -> None:
        self._streams.pop(request_id, None)

    def publish(self, request_id: str, item: object) -> None:
        """From the worker: hand `item` to the request's subscriber, if it has one."""
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._deliver, request_id, item)

    def _deliver(self, request_id: str, item: object) -> None:
        queue = self._streams.get(request_id)
        if queue is not None:
            queue.put_nowait((request_id, item))
            if item is None:
                del self._streams[request_id]

    def notify(self, request_id: str, target: str | None = None) -> None:
        """Called from any thread once the result is stored; also wakes `wait`s on its target
        (retrieve_futures long-polls a sampling session, keyed "target:<id>")."""
        with self._lock:
            events = [self._events.pop(request_id, None)]
            if target is not None:
                events.append(self._events.pop(f"target:{target}", None))
        for event in events:
            if event is not None and self._loop is not None:
                self._loop.call_soon_threadsafe(event.set)
        self.publish(request_id, None)


async def _value(result):
    return await result if inspect.isawaitable(result) else result
