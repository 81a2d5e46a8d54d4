"""`create_app`: the FastAPI application over one `Engine`.

The `AsyncEngine` front is created and started when the app starts (its lifespan) and shut
down when it stops. Every refusal is an OpenAI-shaped JSON error (see `errors.py`).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response

import vecpool
from vecpool.api import Engine
from vecpool.api.async_engine import AsyncEngine
from vecpool.errors import InputError
from vecpool.server.config import ServerConfig
from vecpool.server.errors import (
    ApiError,
    ClientDisconnectedError,
    http_error,
    input_error,
    validation_param,
)
from vecpool.server.metrics import ServerMetrics
from vecpool.server.middleware import ServerMiddleware, error_response
from vecpool.server.routes import ROUTERS
from vecpool.server.state import ServerState

# Not sent to anyone (the client is gone); nginx's code for "client closed request".
STATUS_CLIENT_CLOSED = 499


def create_app(engine: Engine, config: ServerConfig) -> FastAPI:
    """An app serving `engine`; run it with uvicorn (one process, one engine)."""
    state = ServerState(
        engine.info(), engine.context, config, ServerMetrics(lambda: _queued(state))
    )

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        front = AsyncEngine(
            engine,
            max_queued=config.max_queued,
            on_step=state.metrics.on_step,
            on_request_done=state.metrics.on_request_done,
        )
        front.start()
        state.client = front
        state.executor = ThreadPoolExecutor(
            config.tokenizer_threads, thread_name_prefix="vecpool-server-inputs"
        )
        try:
            yield
        finally:
            state.client = None
            state.executor.shutdown(wait=False, cancel_futures=True)
            await asyncio.to_thread(front.shutdown)

    app = FastAPI(title="vecpool", version=vecpool.__version__, lifespan=lifespan)
    app.state.vecpool = state
    for router in ROUTERS:
        app.include_router(router)
    _add_error_handlers(app, state)
    # Read from each router: some FastAPI versions keep an included router as one route.
    paths = (getattr(r, "path", None) for x in (app, *ROUTERS) for r in x.routes)
    endpoints = frozenset(path for path in paths if isinstance(path, str))
    app.add_middleware(
        ServerMiddleware, metrics=state.metrics, api_key=config.api_key, endpoints=endpoints
    )
    return app


def _queued(state: ServerState) -> float:
    return float(state.client.num_queued) if state.client is not None else 0.0


def _add_error_handlers(app: FastAPI, state: ServerState) -> None:
    async def on_api_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, ApiError)
        return error_response(exc)

    async def on_input_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, InputError)
        return error_response(input_error(exc))

    async def on_http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        detail = exc.detail if isinstance(exc.detail, str) else None
        error = http_error(exc.status_code, detail)
        error.headers.update(exc.headers or {})
        return error_response(error)

    async def on_validation_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, RequestValidationError)
        first = exc.errors()[0] if exc.errors() else {"loc": (), "msg": "invalid request"}
        param = validation_param(tuple(first["loc"]))
        return error_response(ApiError(400, f"{param}: {first['msg']}", param=param))

    async def on_disconnect(request: Request, exc: Exception) -> Response:
        state.metrics.disconnects.labels(request.url.path).inc()
        return Response(status_code=STATUS_CLIENT_CLOSED)

    async def on_unexpected(request: Request, exc: Exception) -> Response:
        # Starlette re-raises the exception after this answer, so the server logs it.
        return error_response(ApiError(500, "internal server error", code="internal_error"))

    app.add_exception_handler(ApiError, on_api_error)
    app.add_exception_handler(InputError, on_input_error)
    app.add_exception_handler(HTTPException, on_http_error)
    app.add_exception_handler(RequestValidationError, on_validation_error)
    app.add_exception_handler(ClientDisconnectedError, on_disconnect)
    app.add_exception_handler(Exception, on_unexpected)
