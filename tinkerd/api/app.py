"""The FastAPI app: routers, error mapping, and the wiring of the shared state."""

from __future__ import annotations

import asyncio
import logging
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from tinkerd.api import openai_schema
from tinkerd.api.deps import AppState, error_response
from tinkerd.api.looplag import LoopLag
from tinkerd.api.routes import account, admin, custom_loss, export, futures, rest, sampling, service, sessions, training
from tinkerd.api.routes import archive
from tinkerd.api.routes import metrics, openai
from tinkerd.api.console import pages as console
from tinkerd.errors import Category, TinkerdError, UserError

log = logging.getLogger(__name__)


def create_app(app_state: AppState) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        app_state.control.hub.bind_loop(asyncio.get_running_loop())
        lag = LoopLag(app_state.control.metrics.registry)  # the loop's lag on /metrics (api/looplag.py)
        lag.start()
        yield
        await lag.stop()

    app = FastAPI(title="tinkerd", lifespan=lifespan)
    app.state.tinkerd = app_state

    def shaped(request: Request, e: TinkerdError) -> JSONResponse:
        # /v1 is the OpenAI-compatible API: its errors go out in OpenAI's shape.
        return openai.error_response(e) if openai.is_openai_path(request.url.path) else error_response(e)

    @app.exception_handler(TinkerdError)
    async def on_tinkerd_error(request: Request, e: TinkerdError) -> JSONResponse:
        return shaped(request, e)

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(request: Request, e: RequestValidationError) -> JSONResponse:
        return shaped(request, UserError(f"invalid request: {e.errors()[:3]}"))

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        if openai.is_openai_path(request.url.path):
            return openai_schema.error_response(e.status_code, f"{e.detail}", headers=e.headers)
        # Unknown routes (404) and wrong methods (405, with its Allow header) in the SDK's error shape
        # rather than FastAPI's {"detail": ...}: the SDK puts the body in its error's message.
        category = Category.USER if e.status_code < 500 else Category.SERVER
        return JSONResponse({"error": f"{e.detail}", "category": category}, status_code=e.status_code,
                            headers=e.headers)

    @app.exception_handler(ClientDisconnect)
    async def on_client_gone(request: Request, _: ClientDisconnect) -> Response:
        # The client closed the connection while its body was being read (a cancelled call, a killed
        # process, a timed-out proxy). Nothing is wrong here and nobody will read an answer: one line,
        # no traceback. Handled here rather than by on_unexpected, whose middleware re-raises to
        # uvicorn, which logged a second traceback (two tracebacks, ~8.5 KB of log per drop).
        client = request.client
        log.info("client %s closed the connection during %s %s", f"{client.host}:{client.port}" if client else "?",
                 request.method, request.url.path)
        return Response(status_code=400)  # never sent: uvicorn drops writes to a closed connection

    @app.exception_handler(Exception)
    async def on_unexpected(request: Request, e: Exception) -> JSONResponse:
        log.exception("unhandled error")
        if openai.is_openai_path(request.url.path):
            return openai_schema.error_response(500, f"internal error: {type(e).__name__}")
        return JSONResponse({"error": f"internal error: {type(e).__name__}", "category": "server"}, status_code=500)

    # rest last: its catch-all under /training_runs/{id}/checkpoints/ must not shadow export's routes.
    for module in (service, training, custom_loss, sampling, futures, export, admin, account, sessions, archive, rest):
        for name in ("router", "authed", "public"):
            router = getattr(module, name, None)
            if router is not None:
                app.include_router(router)
    # The OpenAI-compatible /v1 (docs/inference.md) and GET /metrics: no path of theirs overlaps the above.
    for module in (openai, metrics):
        app.include_router(module.router)
    app.include_router(console.router)  # the web console (docs/console.md): all under /console
    return app
