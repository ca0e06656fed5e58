"""The HTTP listener before the app exists: hold requests while the server starts, then hand over.

Why listen before the app is built: a restarted server takes seconds to be ready (the engine child's
imports and model load, then replay), and an SDK whose connections are refused backs off 1, 2, 4,
8, 16, 30 s between retries (tinker/lib/api_future_impl.py). A server ready at 13 s was first
retried at ~15 s, and one ready at 16 s at ~31 s (the 31 s client stall of issue 16). A held
request instead gets its answer as soon as the app is there.

Plain ASGI, no FastAPI: `tinkerd serve` starts listening before it imports the API (~1 s).
"""

from __future__ import annotations

import asyncio
import json

# Under the SDK's 60 s request timeout (tinker/_constants.py): a start slower than this answers 503
# with Retry-After, which the SDK retries, rather than letting the client time out.
HOLD_S = 50.0


class StartupGate:
    def __init__(self, hold_s: float = HOLD_S):
        self.hold_s = hold_s
        self.app = None
        self._opened: asyncio.Event | None = None  # made on the serving loop
        self._lifespan_in: asyncio.Queue | None = None
        self._lifespan_task: asyncio.Task | None = None

    def _event(self) -> asyncio.Event:
        if self._opened is None:
            self._opened = asyncio.Event()
        return self._opened

    async def open(self, app) -> None:
        """Run `app`'s lifespan startup, then serve every held and later request with it."""
        self._lifespan_in = asyncio.Queue()
        started = asyncio.get_running_loop().create_future()
        await self._lifespan_in.put({"type": "lifespan.startup"})

        async def send(message) -> None:
            if message["type"].startswith("lifespan.startup") and not started.done():
                started.set_result(message)

        scope = {"type": "lifespan", "asgi": {"version": "3.0", "spec_version": "2.0"}, "state": {}}
        self._lifespan_task = asyncio.create_task(app(scope, self._lifespan_in.get, send))
        message = await started
        if message["type"] != "lifespan.startup.complete":
            raise RuntimeError(f"the app failed to start: {message.get('message', '')}")
        self.app = app
        self._event().set()

    async def close(self) -> None:
        """The app's lifespan shutdown, when it was opened."""
        if self._lifespan_task is not None and not self._lifespan_task.done():
            await self._lifespan_in.put({"type": "lifespan.shutdown"})
            try:
                await asyncio.wait_for(self._lifespan_task, timeout=10)
            except (asyncio.TimeoutError, Exception):
                pass

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "lifespan":  # uvicorn's; the app's own runs in open()
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    await self.close()
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        if self.app is None and scope["type"] == "http":
            path = scope.get("path", "")
            if path.endswith("/healthz"):  # the process is up
                return await _json(send, 200, {"status": "ok"})
            if path.endswith("/readyz"):  # a load balancer should look elsewhere meanwhile
                return await _json(send, 503, {"status": "starting", "ready": False}, retry_after=True)
            try:
                await asyncio.wait_for(self._event().wait(), timeout=self.hold_s)
            except asyncio.TimeoutError:
                return await _json(send, 503, {"error": "the server is still starting", "category": "server"},
                                   retry_after=True)
        elif self.app is None:
            await self._event().wait()
        await self.app(scope, receive, send)


async def _json(send, status: int, body: dict, retry_after: bool = False) -> None:
    headers = [(b"content-type", b"application/json")]
    if retry_after:
        headers.append((b"retry-after", b"1"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": json.dumps(body).encode()})
