"""The HTTP edge holds: half-sent requests (slowloris) are closed at their read deadline while the
SDK is answered promptly, the deadlines never cut a long-poll or an idle kept-alive connection, and
clients that hang up cost no ERROR and no traceback in the log (api/connection.py, api/app.py)."""

from __future__ import annotations

import socket
import threading
import time

import httpx
import pytest
import tinker
from tinker import types

from tests.conformance.conftest import TINY
from tests.conformance.test_sdk_errors import _fwdbwd_proto
from tests.serverproc import API_KEY, start_server

HEAD_TIMEOUT_S, BODY_TIMEOUT_S, LONG_POLL_S = 2.0, 3.0, 5.0
MAX_CONNECTIONS = 260  # above the 200 half-sent connections plus the SDK's few
SLACK_S = 1.5  # event-loop and scheduling delay on 2 shared cores
HEADERS = {"X-API-Key": API_KEY}


@pytest.fixture(scope="module")
def edge_server(tmp_path_factory):
    # One token a minute: the first op runs (an op over the whole budget runs alone), the next waits
    # ~60 s in the queue, so its retrieve_future long-polls for LONG_POLL_S.
    srv = start_server(tmp_path_factory.mktemp("edge-data"), [TINY], [
        "--threads", "1", "--request-head-timeout-s", str(HEAD_TIMEOUT_S),
        "--request-body-timeout-s", str(BODY_TIMEOUT_S), "--retrieve-future-timeout-s", str(LONG_POLL_S),
        "--max-tokens-per-minute", "1", "--max-connections", str(MAX_CONNECTIONS)], log_level="INFO")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def pending_request_id(edge_server):
    sc = tinker.ServiceClient(base_url=edge_server.url, api_key=API_KEY)
    tc = sc.create_lora_training_client(base_model=TINY, rank=4).result()
    datum = types.Datum(model_input=types.ModelInput.from_ints([1, 2, 3]),
                        loss_fn_inputs={"target_tokens": [2, 3, 4], "weights": [1.0, 1.0, 1.0]})
    tc.forward([datum], "cross_entropy").result()  # spends the minute's token budget
    r = httpx.post(f"{edge_server.url}/api/v1/forward_backward", content=_fwdbwd_proto(tc.model_id, 10_000),
                   headers={**HEADERS, "content-type": "application/x-protobuf"})
    assert r.status_code == 200, r.text
    return r.json()["request_id"]


def _port(server) -> int:
    return int(server.url.rsplit(":", 1)[1])


def _request_head(path: str, length: int) -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: t\r\nX-API-Key: {API_KEY}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {length}\r\n\r\n").encode()


def _closed_at(socks: list[socket.socket], t0: float, until_s: float) -> dict[int, float]:
    """Seconds after t0 at which the server closed each socket (read EOF or reset)."""
    for s in socks:
        s.setblocking(False)
    closed: dict[int, float] = {}
    while len(closed) < len(socks) and time.monotonic() - t0 < until_s:
        for i, s in enumerate(socks):
            if i not in closed:
                try:
                    if s.recv(4096) == b"":
                        closed[i] = time.monotonic() - t0
                except BlockingIOError:
                    pass
                except OSError:
                    closed[i] = time.monotonic() - t0
        time.sleep(0.05)
    return closed


def _read_response(s: socket.socket) -> bytes:
    data = b""
    while b"\r\n\r\n" not in data:
        data += s.recv(65536)
    head, _, rest = data.partition(b"\r\n\r\n")
    length = int(next(line.split(b":")[1] for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")))
    while len(rest) < length:
        rest += s.recv(65536)
    return head + b"\r\n\r\n" + rest


def _log_since(server, mark: int) -> str:
    return "".join(server.lines[mark:])


def test_half_sent_requests_are_closed_at_their_deadline_while_the_sdk_is_answered(edge_server):
    port = _port(edge_server)
    sc = tinker.ServiceClient(base_url=edge_server.url, api_key=API_KEY)
    sc.get_server_capabilities()  # connect and warm up outside the timing
    mark = len(edge_server.lines)
    t0 = time.monotonic()
    silent = [socket.create_connection(("127.0.0.1", port)) for _ in range(50)]  # never send a byte
    half_heads = [socket.create_connection(("127.0.0.1", port)) for _ in range(50)]
    for s in half_heads:
        s.sendall(b"POST /api/v1/retrieve_future HTTP/1.1\r\nHost: t\r\nX-API-")
    dripping = [socket.create_connection(("127.0.0.1", port)) for _ in range(100)]
    for s in dripping:
        s.sendall(_request_head("/api/v1/retrieve_future", 1000) + b"{")
    opened_s = time.monotonic() - t0
    stop = threading.Event()

    def drip() -> None:  # one byte a second on each body, a head byte on each half head
        while not stop.wait(1.0):
            for s in dripping + half_heads:
                try:
                    s.send(b" ")
                except OSError:
                    pass

    threading.Thread(target=drip, daemon=True).start()
    try:
        latencies = []
        while time.monotonic() - t0 < BODY_TIMEOUT_S:  # the SDK meanwhile, the whole time
            start = time.monotonic()
            sc.get_server_capabilities()
            latencies.append(time.monotonic() - start)
        closed = _closed_at(silent + half_heads + dripping, t0, BODY_TIMEOUT_S + opened_s + 10)
    finally:
        stop.set()
        for s in silent + half_heads + dripping:
            s.close()
    assert max(latencies) < 1.0, latencies  # ~0.03 s each unloaded
    heads = [closed.get(i) for i in range(100)]
    bodies = [closed.get(i) for i in range(100, 200)]
    assert None not in heads and max(heads) < HEAD_TIMEOUT_S + opened_s + SLACK_S, heads
    assert None not in bodies and max(bodies) < BODY_TIMEOUT_S + opened_s + SLACK_S, bodies
    assert min(heads) > HEAD_TIMEOUT_S - 0.2 and min(bodies) > BODY_TIMEOUT_S - 0.2  # not before
    log = _log_since(edge_server, mark)
    assert log.count("its request head was not complete after 2 s") == 100
    assert log.count("its request body was not complete after 3 s") == 100
    assert "ERROR" not in log and "Traceback" not in log


def test_the_deadlines_spare_long_polls_and_idle_kept_alive_connections(edge_server, pending_request_id):
    s = socket.create_connection(("127.0.0.1", _port(edge_server)))
    s.settimeout(LONG_POLL_S + 10)
    body = f'{{"request_id": "{pending_request_id}"}}'.encode()
    for _ in range(2):  # the second request on the same connection after an idle gap past both deadlines
        start = time.monotonic()
        s.sendall(_request_head("/api/v1/retrieve_future", len(body)) + body)
        answer = _read_response(s)
        assert answer.startswith(b"HTTP/1.1 408") and b"try_again" in answer, answer
        assert time.monotonic() - start > LONG_POLL_S - 0.5  # held the whole long-poll, past both deadlines
        time.sleep(BODY_TIMEOUT_S + 0.5)
    s.close()


def test_clients_that_hang_up_cost_no_error_and_no_traceback(edge_server, pending_request_id):
    port = _port(edge_server)
    mark = len(edge_server.lines)
    poll = f'{{"request_id": "{pending_request_id}"}}'.encode()
    socks = []
    for i in range(50):
        s = socket.create_connection(("127.0.0.1", port))
        if i % 2:  # mid-body: the head and part of the body, then gone
            s.sendall(_request_head("/api/v1/retrieve_future", 1000) + b'{"request_id": ')
        else:  # mid-long-poll: a whole retrieve_future of a pending op, then gone while it is held
            s.sendall(_request_head("/api/v1/retrieve_future", len(poll)) + poll)
        socks.append(s)
    time.sleep(0.5)
    for s in socks:
        s.close()
    time.sleep(LONG_POLL_S + 1)  # the held polls end and answer nobody
    log = _log_since(edge_server, mark)
    assert "ERROR" not in log and "Traceback" not in log, log[:3000]
    assert log.count("\n") <= 50, log  # at most one line a drop
    assert log.count("closed the connection during POST /api/v1/retrieve_future") == 25


def test_deep_json_and_unknown_routes_are_user_errors_in_the_sdks_shape(edge_server):
    deep = b"[" * 100_000 + b"]" * 100_000
    for path in ("/api/v1/weights_info", "/api/v1/sessions/s/finish", "/api/v1/retrieve_future"):
        r = httpx.post(edge_server.url + path, content=deep, headers={**HEADERS, "content-type": "application/json"})
        # weights_info and finish answered 500 RecursionError, which the SDK retries for minutes
        assert (r.status_code, r.json()["category"]) == (400, "user"), (path, r.text)
        assert "nested more than 64 levels" in r.json()["error"]
    r = httpx.get(edge_server.url + "/api/v1/no_such_thing", headers=HEADERS)
    assert (r.status_code, r.json()) == (404, {"error": "Not Found", "category": "user"})
    r = httpx.get(edge_server.url + "/api/v1/weights_info", headers=HEADERS)
    assert (r.status_code, r.json(), r.headers["allow"]) == (405, {"error": "Method Not Allowed", "category": "user"}, "POST")


def test_past_max_connections_requests_get_a_503_until_the_deadlines_free_places(edge_server):
    port = _port(edge_server)
    silent = [socket.create_connection(("127.0.0.1", port)) for _ in range(MAX_CONNECTIONS)]
    try:
        with httpx.Client(base_url=edge_server.url, headers=HEADERS) as plain:  # no retries, unlike the SDK
            assert plain.get("/api/v1/get_server_capabilities").status_code == 503  # which the SDK retries
            time.sleep(HEAD_TIMEOUT_S + SLACK_S)  # the silent ones are closed at their head deadline
            assert plain.get("/api/v1/get_server_capabilities").status_code == 200
    finally:
        for s in silent:
            s.close()
