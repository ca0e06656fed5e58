"""Every error the server can produce is classified for the SDK: a category and a status that
tells the SDK whether to retry (it retries 408/409/429 and 5xx for minutes), in one JSON shape
{"error", "category"}, including FastAPI's own 404/405 and the generic 500. A client that hangs up
while its body is read costs one INFO line, not an ERROR with two tracebacks."""

from __future__ import annotations

import ast
import asyncio
import importlib
import logging
from pathlib import Path
from types import SimpleNamespace

import pytest
from fastapi import Request
from fastapi.testclient import TestClient

import tinkerd
from tinkerd.api.app import create_app
from tinkerd.api.deps import error_response, read_body
from tinkerd.errors import TinkerdError

SDK_RETRIES = {408, 409, 429}
ROOT = Path(tinkerd.__file__).parent


def error_classes_in_source() -> dict[str, str]:
    """Class name -> module of every class in tinkerd/ that derives, by name, from TinkerdError."""
    defs = []  # (class name, base names, module)
    for path in ROOT.rglob("*.py"):
        module = ".".join(("tinkerd", *path.relative_to(ROOT).with_suffix("").parts))
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                bases = {b.id if isinstance(b, ast.Name) else b.attr for b in node.bases if isinstance(b, (ast.Name, ast.Attribute))}
                defs.append((node.name, bases, module))
    found = {"TinkerdError": "tinkerd.errors"}
    while True:
        more = {name: mod for name, bases, mod in defs if name not in found and bases & found.keys()}
        if not more:
            return found
        found.update(more)


def problems(cls: type[TinkerdError]) -> list[str]:
    e = cls("x")
    if cls is TinkerdError:
        return []  # the abstract base; its defaults are a server error's
    if e.category == "user":
        if not 400 <= e.status_code < 500:
            return [f"{cls.__name__}: a user error must be 4xx, is {e.status_code}"]
        if e.status_code in SDK_RETRIES:
            return [f"{cls.__name__}: user error with {e.status_code}, which the SDK retries"]
    elif e.category == "server":
        # 429 is the server's too: a queue over its budget (QueueFull), which the SDK backs off from.
        if not (500 <= e.status_code < 600 or e.status_code == 429):
            return [f"{cls.__name__}: a server error must be 5xx or 429, is {e.status_code}"]
    else:
        return [f"{cls.__name__}: category {e.category!r} is neither 'user' nor 'server'"]
    return []


def test_every_tinkerd_error_has_a_category_and_a_status_the_sdk_reads_right():
    names = error_classes_in_source()
    assert {"UserError", "NotFoundError", "ServerError", "AuthError", "PayloadTooLarge", "Forbidden"} <= names.keys()
    classes = []
    for name, module in names.items():
        cls = getattr(importlib.import_module(module), name)
        assert issubclass(cls, TinkerdError), name
        classes.append(cls)
    # Nothing derived at run time escapes the source scan.
    seen, todo = set(), [TinkerdError]
    while todo:
        for sub in todo.pop().__subclasses__():
            if sub.__module__.startswith("tinkerd.") and sub not in seen:
                seen.add(sub)
                todo.append(sub)
    assert {c.__name__ for c in seen} <= names.keys()
    assert [p for cls in classes for p in problems(cls)] == []
    for cls in classes:
        e = cls("why")
        response = error_response(e)
        assert response.status_code == e.status_code and response.body == f'{{"error":"why","category":"{e.category}"}}'.encode()


def test_every_error_is_defined_in_errors_py_with_the_enums():
    """One place for the hierarchy (issue 18): no module defines its own error class, and each
    class's category and status are the enums' members, not loose strings and ints."""
    from http import HTTPStatus

    from tinkerd.errors import Category

    names = error_classes_in_source()
    assert {name: module for name, module in names.items() if module != "tinkerd.errors"} == {}
    for name in names:
        cls = getattr(importlib.import_module("tinkerd.errors"), name)
        e = cls("why")
        assert isinstance(e.category, Category) and isinstance(e.status_code, HTTPStatus), name


def test_the_check_catches_a_misclassified_error():
    from tinkerd.errors import ServerError, UserError

    bad = [type("RateLimited", (UserError,), {"status_code": 429, "__module__": "tests"}),
           type("Teapot", (ServerError,), {"status_code": 418, "__module__": "tests"}),
           type("Odd", (TinkerdError,), {"category": "client", "__module__": "tests"})]
    assert all(problems(cls) for cls in bad)


@pytest.fixture
def client():
    accounts = SimpleNamespace(verify=lambda key: "local" if key == "k" else None)
    app_state = SimpleNamespace(config=SimpleNamespace(max_body_bytes=1 << 20), accounts=accounts)
    app = create_app(app_state)

    @app.post("/test/boom")
    async def boom():
        raise RuntimeError("a bug")

    @app.post("/test/body")
    async def body(request: Request):
        return {"n": len(await read_body(request))}

    return TestClient(app, raise_server_exceptions=False)


def test_unknown_routes_and_wrong_methods_answer_in_the_sdks_error_shape(client):
    r = client.get("/api/v1/no_such_route")
    assert (r.status_code, r.json()) == (404, {"error": "Not Found", "category": "user"})
    r = client.get("/api/v1/retrieve_future")
    assert (r.status_code, r.json()) == (405, {"error": "Method Not Allowed", "category": "user"})
    assert r.headers["allow"] == "POST"


def test_an_unexpected_exception_is_a_500_with_category_server(client, caplog):
    r = client.post("/test/boom")
    assert (r.status_code, r.json()) == (500, {"error": "internal error: RuntimeError", "category": "server"})
    assert any(rec.levelno == logging.ERROR for rec in caplog.records)  # a real bug is still loud


def test_a_client_gone_while_its_body_is_read_is_one_info_line(client, caplog):
    app = client.app
    sent = []

    async def receive():
        return {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
             "path": "/test/body", "raw_path": b"/test/body", "query_string": b"", "root_path": "",
             "headers": [(b"content-length", b"100")], "client": ("10.0.0.1", 5555), "server": ("s", 80),
             "scheme": "http", "state": {}}
    caplog.set_level(logging.INFO)
    asyncio.run(app(scope, receive, send))  # re-raised to the server before: uvicorn's second traceback
    records = [r for r in caplog.records if r.name.startswith(("tinkerd", "uvicorn"))]
    assert [(r.levelno, r.exc_info) for r in records] == [(logging.INFO, None)]
    assert "10.0.0.1:5555 closed the connection during POST /test/body" in records[0].getMessage()
