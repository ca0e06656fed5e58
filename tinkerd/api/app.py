"""The FastAPI app: routers, error mapping, and the wiring of the shared state."""

from __future__ import annotations

import asyncio
import logging
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from tinkerd.api.deps import AppState, error_response
from tinkerd.api.routes import admin, export, futures, rest, sampling, service, training
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

    @app.exception_handler(Exception)
    async def on_unexpected(_: Request, e: Exception) -> JSONResponse:
        log.exception("unhandled error")
        return JSONResponse({"error": f"internal error: {type(e).__name__}", "category": "server"}, status_code=500)

    # rest last: its catch-all under /training_runs/{id}/checkpoints/ must not shadow export's routes.
    for module in (service, training, sampling, futures, export, admin, rest):
        for name in ("router", "authed"):
            router = getattr(module, name, None)
            if router is not None:
                app.include_router(router)
    return app
