"""The FastAPI application: `create_app` over an `Engine` in this process, `create_api_app` for
an API-server process whose engine runs in the engine process.

Either way the app knows the engine through its `EngineInfo`, prepares calls with a
`CallContext`, and runs them on an `EngineClient` started with the app (its lifespan) and
stopped with it. Every refusal is an OpenAI-shaped JSON error (see `errors.py`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import TYPE_CHECKING

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

import vecpool
from vecpool.calls import CallContext, EngineInfo
from vecpool.errors import InputError
from vecpool.server.config import ServerConfig
from vecpool.server.errors import (
    ApiError,
    ClientDisconnectedError,
    http_error,
    in_dialect,
    input_error,
    release_frames,
    validation_param,
)
from vecpool.server.metrics import ServerMetrics
from vecpool.server.middleware import STATUS_CLIENT_CLOSED, ServerMiddleware, error_response
from vecpool.server.routes import ROUTERS
from vecpool.server.state import ServerState

if TYPE_CHECKING:  # the process layout's modules (ZeroMQ, msgspec) load only where used
    from vecpool.api import Engine
    from vecpool.server.served import ServedModelsClient

Lifespan = Callable[[FastAPI], AbstractAsyncContextManager[None]]


def create_app(engine: Engine, config: ServerConfig) -> FastAPI:
    """An app serving `engine` in this process (its loop in a thread: `AsyncEngine`); run it
    with uvicorn."""
    # This process runs the engine: the one place the app imports it (the API processes of
    # `vecpool serve` never do).
    from vecpool.api.async_engine import AsyncEngine

    metrics = ServerMetrics(lambda: _queued(state))
    state = ServerState(engine.info(), engine.context, config, metrics)
    assert metrics.engine is not None

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        assert metrics.engine is not None
        metrics.engine.follow_prefix_cache(engine.core)
        front = AsyncEngine(
            engine,
            max_queued=config.max_queued,
            max_wait=config.max_queue_wait,
            on_step=metrics.engine.on_step,
            on_request_done=metrics.engine.on_request_done,
        )
        metrics.engine.follow_admission(front.admission)
        front.start()
        state.client = front
        async with _executor(state):
            try:
                yield
            finally:
                state.client = None
                await asyncio.to_thread(front.shutdown)

    return _build(state, lifespan)


def create_api_app(
    infos: EngineInfo | Sequence[EngineInfo],
    config: ServerConfig,
    client: ServedModelsClient,
    *,
    multiprocess_dir: str | None = None,
) -> FastAPI:
    """An API-server process's app: calls prepared here (tokenizer and rules from each
    model's info, no model), run on the engine processes through `client` (one group per
    model, in `config.served_model_names`' order). `multiprocess_dir`: where every process of
    the server records its metrics (`/metrics` sums them)."""
    infos = [infos] if isinstance(infos, EngineInfo) else list(infos)
    names = config.served_model_names
    if not len(infos) == len(client.groups) == len(names):
        raise ValueError("create_api_app needs one engine info and one group per served model")
    metrics = ServerMetrics(multiprocess_dir=multiprocess_dir)
    state = ServerState(infos[0], CallContext.from_info(infos[0]), config, metrics)
    models = [state] + [
        ServerState(
            info,
            CallContext.from_info(info),
            dataclasses.replace(config, model_names=model_names, other_model_names=()),
            metrics,
        )
        for info, model_names in zip(infos[1:], names[1:], strict=True)
    ]
    state.models = {name: model for model, n in zip(models, names, strict=True) for name in n}

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await client.start()
        state.client = client  # the server's as a whole; its calls run on the first model
        state.model_client = client.groups[0]
        for model, group in zip(models[1:], client.groups[1:], strict=True):
            model.client = group
        async with _executor(state):
            try:
                yield
            finally:
                for model in models:
                    model.client = model.model_client = None
                await client.close()

    return _build(state, lifespan)


# Threads that prepare calls with images: mostly waiting on image hosts (up to the media
# policy's timeouts each), so more than the cores; made as calls come, none before.
MEDIA_THREADS = 16


@asynccontextmanager
async def _executor(state: ServerState) -> AsyncIterator[None]:
    """The thread pools that decode and tokenize inputs, and that read images, for the app's
    lifetime."""
    executor = ThreadPoolExecutor(
        state.config.tokenizer_threads, thread_name_prefix="vecpool-server-inputs"
    )
    media = ThreadPoolExecutor(MEDIA_THREADS, thread_name_prefix="vecpool-server-media")
    for model in state.each_model():  # several models share them
        model.executor = executor
        model.media_executor = media
    try:
        yield
    finally:
        for model in state.each_model():
            model.executor = model.media_executor = None
        executor.shutdown(wait=False, cancel_futures=True)
        media.shutdown(wait=False, cancel_futures=True)


class App(FastAPI):
    """FastAPI, except that a POST to a route whose endpoint takes the bare request and nothing
    else (every route that does work) runs without FastAPI's router and middleware: the same
    endpoint, the same `ServerMiddleware` around it, the same exception handlers. Those layers
    (routing, dependency solving, an exit stack, telemetry and body-limit middleware) have
    nothing to do for such an endpoint, and took a third of the app's CPU for a single-query
    request (FastAPI's path 1.5x the fast one, `benchmarks/lab/bench_api_request.py`). Any other request, one to a path
    under a root path, and every request once a middleware has been added to the app after it
    was built, goes through FastAPI whole."""

    fast_routes: dict[tuple[str, str], Callable[[Request], Awaitable[Response]]]
    fast_app: ServerMiddleware | None = None
    fast_middleware = 0  # the middleware the fast path stands for (any added since: none)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            self.fast_app is not None
            and scope["type"] == "http"
            and (scope["method"], scope["path"]) in self.fast_routes
            and len(self.user_middleware) == self.fast_middleware
        ):
            scope["app"] = self  # where a request finds the server's state
            await self.fast_app(scope, receive, send)
            return
        await super().__call__(scope, receive, send)

    def serve_fast(
        self, routes: Iterable[object], state: ServerState, endpoints: frozenset[str]
    ) -> None:
        """Run the POST endpoints among `routes` that take only the request around FastAPI
        (once every route and exception handler is in place)."""
        self.fast_routes = {
            ("POST", route.path): route.endpoint
            for route in routes
            if isinstance(route, APIRoute)
            and "POST" in (route.methods or ())
            and _takes_only_the_request(route)
        }
        self.fast_app = ServerMiddleware(self._run_fast, state=state, endpoints=endpoints)
        # A middleware a user adds later (CORS, say) must see every request: FastAPI's path.
        self.fast_middleware = len(self.user_middleware)

    async def _run_fast(self, scope: Scope, receive: Receive, send: Send) -> None:
        request = Request(scope, receive, send)
        try:
            response = await self.fast_routes[scope["method"], scope["path"]](request)
        except Exception as exc:
            # As FastAPI's exception middleware does: the handler of the exception's nearest
            # class; none (an unexpected error) is raised on to `ServerMiddleware`.
            handler = next(
                (
                    self.exception_handlers[cls]
                    for cls in type(exc).__mro__
                    if cls is not Exception and cls in self.exception_handlers
                ),
                None,
            )
            if handler is None:
                raise
            answer = handler(request, exc)  # a coroutine here; Starlette allows a function
            response = await answer if inspect.isawaitable(answer) else answer
        await response(scope, receive, send)


def _takes_only_the_request(route: APIRoute) -> bool:
    d = route.dependant
    return d.request_param_name is not None and not (
        d.path_params
        or d.query_params
        or d.header_params
        or d.cookie_params
        or d.body_params
        or d.dependencies
        or d.websocket_param_name
        or d.http_connection_param_name
        or d.response_param_name
        or d.background_tasks_param_name
        or d.security_scopes_param_name
    )


def _build(state: ServerState, lifespan: Lifespan) -> FastAPI:
    app = App(title="vecpool", version=vecpool.__version__, lifespan=lifespan)
    app.state.vecpool = state
    for router in ROUTERS:
        app.include_router(router)
    _add_error_handlers(app, state)
    # Read from each router: some FastAPI versions keep an included router as one route.
    routes = [r for x in (app, *ROUTERS) for r in x.routes]
    paths = (getattr(r, "path", None) for r in routes)
    endpoints = frozenset(path for path in paths if isinstance(path, str))
    app.add_middleware(ServerMiddleware, state=state, endpoints=endpoints)
    app.serve_fast(routes, state, endpoints)
    return app


def _queued(state: ServerState) -> float:
    return float(state.client.num_queued) if state.client is not None else 0.0


def _add_error_handlers(app: FastAPI, state: ServerState) -> None:
    # Each answer of an expected error releases what the error's frames held (`release_frames`);
    # an unexpected one is logged with its traceback after its answer, so it keeps them.
    async def on_api_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, ApiError)
        release_frames(exc)
        return error_response(in_dialect(request.scope["path"], exc))

    async def on_input_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, InputError)
        release_frames(exc)
        return error_response(in_dialect(request.scope["path"], input_error(exc)))

    async def on_http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        release_frames(exc)
        detail = exc.detail if isinstance(exc.detail, str) else None
        error = http_error(exc.status_code, detail)
        error.headers.update(exc.headers or {})
        return error_response(error)

    async def on_validation_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, RequestValidationError)
        release_frames(exc)
        first = exc.errors()[0] if exc.errors() else {"loc": (), "msg": "invalid request"}
        param = validation_param(tuple(first["loc"]))
        return error_response(ApiError(400, f"{param}: {first['msg']}", param=param))

    async def on_disconnect(request: Request, exc: Exception) -> Response:
        release_frames(exc)
        state.metrics.disconnects.labels(request.scope["path"]).inc()
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
