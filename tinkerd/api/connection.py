"""The HTTP/1.1 connection: uvicorn's h11 protocol with deadlines for reading a request.

uvicorn times out only an idle keep-alive connection, after a response. A connection that never
completes its request head, or that sends its body a byte a second, is held forever: 1000 such
half-sent requests were all still attached after 32 s (issue 16), and the 200 of
tests/conformance/test_http_connections.py after 15 s, each holding a socket and a descriptor.
The ASGI app cannot help, as it is called only once the head is complete. So the protocol keeps one
deadline per request, never extended by the bytes that trickle in:

- the head (request line and headers) must be complete `head_timeout_s` after the connection opens,
  or after the first byte of the next request on a kept-alive connection;
- the body must be complete `body_timeout_s` after the head.

A request past its deadline has its connection closed without an answer (the app, if it was reading
the body, sees a disconnect). The deadline ends when the request is read: the response side (the
20 s long-poll of retrieve_future) is never timed here.
"""

from __future__ import annotations

import asyncio
import logging

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger(__name__)


class TimedH11Protocol(H11Protocol):
    """Give uvicorn.Config(http=...) the class from `with_timeouts`: uvicorn builds one per connection."""

    head_timeout_s: float = 10.0
    body_timeout_s: float = 60.0

    @classmethod
    def with_timeouts(cls, head_timeout_s: float, body_timeout_s: float) -> type[TimedH11Protocol]:
        return type(cls.__name__, (cls,), {"head_timeout_s": head_timeout_s, "body_timeout_s": body_timeout_s})

    def __init__(self, config, server_state, app_state, _loop=None) -> None:
        super().__init__(config, server_state, app_state, _loop)
        self._deadline: asyncio.TimerHandle | None = None
        self._phase: str | None = None  # "head" | "body" | None: what the running deadline is for

    def connection_made(self, transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm("head")  # a connection that sends nothing at all is a half-sent head too

    def connection_lost(self, exc) -> None:
        self._arm(None)
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._follow()

    def on_response_complete(self) -> None:
        super().on_response_complete()  # may start the next pipelined request
        self._follow()

    def _follow(self) -> None:
        """Set the deadline for what the connection now waits for from the client."""
        if self.transport.is_closing():
            return self._arm(None)
        state = self.conn.their_state
        if state is h11.IDLE:
            # Bytes of a next request buffered: its head is due. None: an idle kept-alive connection,
            # which uvicorn's keep-alive timer closes.
            self._arm("head" if self.conn.trailing_data[0] or self._phase == "head" else None)
        elif state is h11.SEND_BODY:
            self._arm("body")
        else:  # DONE, MUST_CLOSE, ...: the request is read
            self._arm(None)

    def _arm(self, phase: str | None) -> None:
        if phase == self._phase:
            return  # the same deadline runs on: trickled bytes never extend it
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None
        self._phase = phase
        if phase is not None:
            timeout_s = self.head_timeout_s if phase == "head" else self.body_timeout_s
            self._deadline = self.loop.call_later(timeout_s, self._expire, phase, timeout_s)

    def _expire(self, phase: str, timeout_s: float) -> None:
        self._deadline = None
        if self.transport.is_closing():
            return
        client = "%s:%d" % self.client if self.client else "?"
        log.info("closing the connection from %s: its request %s was not complete after %g s", client, phase, timeout_s)
        self.transport.close()
