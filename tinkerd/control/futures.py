"""Wake long-polling retrieve_future calls when their result lands.

Results are written by the engine worker thread; pollers wait on asyncio events in the server's
event loop. The hub bridges the two with call_soon_threadsafe, so a poller wakes within a loop
tick of completion instead of polling the store.
"""

from __future__ import annotations

import asyncio
import threading


class FutureHub:
    def __init__(self) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        self._events: dict[str, asyncio.Event] = {}
        self._lock = threading.Lock()

    def bind_loop(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop

    async def wait(self, request_id: str, timeout_s: float, is_done) -> bool:
        """Wait until `is_done()` or the timeout. Must run on the bound loop."""
        with self._lock:
            event = self._events.get(request_id)
            if event is None:
                event = self._events[request_id] = asyncio.Event()
        # Checked after registering: a completion between the caller's check and now still wakes us.
        if is_done():
            return True
        try:
            await asyncio.wait_for(event.wait(), timeout_s)
            return True
        except asyncio.TimeoutError:
            return is_done()

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
