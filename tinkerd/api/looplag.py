"""How late the event loop wakes: the `tinkerd_event_loop_lag_seconds` histogram on GET /metrics.

Every long-poll, body read and response of the server runs on one asyncio loop, so any blocking call
on it (a store query, an rmtree) delays all of them by its duration. A probe task sleeps
`INTERVAL_S` and records by how much its wake-up overshot: on an idle loop that is the scheduler's
jitter (~0.1 ms); a 50 ms call on the loop shows as ~50 ms. benchmarks/event_loop.py reads it.
"""

from __future__ import annotations

import asyncio
import time

from prometheus_client import CollectorRegistry, Histogram

# 20 wake-ups a second: ~20 µs of loop time each second, and a stall of 50 ms or more is never
# missed (a shorter one is caught with probability ~ its length / 50 ms).
INTERVAL_S = 0.05
# From the loop's own jitter to a stall that a client would time out on.
_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)


class LoopLag:
    def __init__(self, registry: CollectorRegistry, interval_s: float = INTERVAL_S):
        self.interval_s = interval_s
        self.histogram = Histogram("tinkerd_event_loop_lag_seconds", "How late the API's event loop woke from a "
                                   f"{interval_s * 1000:g} ms sleep", buckets=_BUCKETS, registry=registry)
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        """On the running loop (the app's lifespan)."""
        self._task = asyncio.get_running_loop().create_task(self._probe(), name="tinkerd-loop-lag")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass

    async def _probe(self) -> None:
        while True:
            start = time.perf_counter()
            await asyncio.sleep(self.interval_s)
            self.histogram.observe(max(0.0, time.perf_counter() - start - self.interval_s))
