"""`tinkerd serve`'s HTTP connection flags reach ServerConfig and uvicorn (cli/serve.py: uvicorn_config)."""

from __future__ import annotations

import argparse

from tinkerd.api.connection import TimedH11Protocol
from tinkerd.cli import serve
from tinkerd.config import ServerConfig


def _args(*argv: str):
    parser = argparse.ArgumentParser()
    serve.add_parser(parser.add_subparsers())
    return parser.parse_args(["serve", *argv])


def test_flags_reach_uvicorn():
    config = serve.build_config(_args("--request-head-timeout-s", "3", "--request-body-timeout-s", "7",
                                      "--keep-alive-timeout-s", "30", "--max-connections", "10",
                                      "--listen-backlog", "64", "--max-request-head-bytes", "4096"))
    u = serve.uvicorn_config(object(), config)
    assert issubclass(u.http, TimedH11Protocol) and (u.http.head_timeout_s, u.http.body_timeout_s) == (3, 7)
    assert (u.timeout_keep_alive, u.limit_concurrency, u.backlog, u.h11_max_incomplete_event_size) == (30, 10, 64, 4096)


def test_defaults():
    u = serve.uvicorn_config(object(), serve.build_config(_args()))
    assert (u.http.head_timeout_s, u.http.body_timeout_s) == (10, 60)
    assert (u.timeout_keep_alive, u.limit_concurrency, u.backlog, u.h11_max_incomplete_event_size) == (75, 2048, 2048, 16384)
    assert ServerConfig().request_head_timeout_s == 10  # the same defaults without the CLI


def test_the_otlp_endpoint_comes_from_the_flag_else_opentelemetrys_variables_read_by_serverconfig(monkeypatch):
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", raising=False)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://collector:4318")
    assert ServerConfig().otlp_endpoint == "http://collector:4318"
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "http://traces:4318/v1/traces")
    assert serve.build_config(_args()).otlp_endpoint == "http://traces:4318/v1/traces"
    assert serve.build_config(_args("--otlp-endpoint", "http://flag:4318")).otlp_endpoint == "http://flag:4318"
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_ENDPOINT")
    assert ServerConfig().otlp_endpoint is None


def test_accepted_connections_send_without_nagle_delay():
    """The server's socket makes asyncio turn Nagle off on every accepted connection (TCP_NODELAY):
    with it on, a response's body waited for the client's delayed ACK of its head, ~44 ms a request."""
    import asyncio
    import socket

    async def accepted_nodelay() -> int:
        sock = serve.listening_socket("127.0.0.1", 0)
        seen: asyncio.Future = asyncio.get_running_loop().create_future()

        async def on_connect(reader, writer):
            seen.set_result(writer.get_extra_info("socket").getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
            writer.close()

        server = await asyncio.start_server(on_connect, sock=sock)
        async with server:
            _, writer = await asyncio.open_connection(*sock.getsockname()[:2])
            value = await asyncio.wait_for(seen, 10)
            writer.close()
        return value

    assert asyncio.run(accepted_nodelay()) != 0
