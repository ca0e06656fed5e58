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

from tinkerd.api.deps import AppState, error_response
from tinkerd.api.routes import account, admin, export, futures, rest, sampling, service, sessions, training
from tinkerd.errors import TinkerdError, UserError

log = logging.getLogger(__name__)


def create_app(app_state: AppState) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        app_state.control.hub.bind_loop(asyncio.get_running_loop())
        yield

    app = FastAPI(title="tinkerd", lifespan=lifespan)
    app.state.tinkerd = app_state

    @app.exception_handler(TinkerdError)
    async def on_tinkerd_error(_: Request, e: TinkerdError) -> JSONResponse:
        return error_response(e)

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(_: Request, e: RequestValidationError) -> JSONResponse:
        return error_response(UserError(f"invalid request: {e.errors()[:3]}"))

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(_: Request, e: StarletteHTTPException) -> JSONResponse:
        # Unknown routes (404) and wrong methods (405, with its Allow header) in the SDK's error shape
        # rather than FastAPI's {"detail": ...}: the SDK puts the body in its error's message.
        category = "user" if e.status_code < 500 else "server"
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
    async def on_unexpected(_: Request, e: Exception) -> JSONResponse:
        log.exception("unhandled error")
        return JSONResponse({"error": f"internal error: {type(e).__name__}", "category": "server"}, status_code=500)

    # rest last: its catch-all under /training_runs/{id}/checkpoints/ must not shadow export's routes.
    for module in (service, training, sampling, futures, export, admin, account, sessions, rest):
        for name in ("router", "authed", "public"):
            router = getattr(module, name, None)
            if router is not None:
                app.include_router(router)
    return app
