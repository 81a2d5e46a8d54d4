"""What every endpoint shares: the server's state, body parsing, and the run of one call.

A call goes: read and validate the body → check the model name and the limits → decode and
tokenize off the event loop → queue on the `AsyncEngine` → wait, racing the client's
disconnect (which cancels the call's requests, so waiting ones never run) → timings.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError
from starlette.requests import Request as HttpRequest

from vecpool.api import Engine, PreparedCall
from vecpool.api.async_engine import AsyncEngine, QueueFullError
from vecpool.engine.request import Request, RequestStatus
from vecpool.errors import InputError, VecpoolError
from vecpool.server.codec import EncodedEmbeds
from vecpool.server.config import ServerConfig
from vecpool.server.errors import ApiError, ClientDisconnectedError, input_error, validation_param
from vecpool.server.metrics import ServerMetrics
from vecpool.server.protocol import TextParams

M = TypeVar("M", bound=BaseModel)
T = TypeVar("T")
_PARSE_INLINE_BYTES = 64 * 1024


@dataclass
class ServerState:
    """One engine, its async front (set at startup), the settings and the metrics."""

    engine: Engine
    config: ServerConfig
    metrics: ServerMetrics
    front: AsyncEngine | None = None  # set at startup
    executor: Executor | None = None  # decodes and tokenizes inputs; set at startup
    created: int = field(default_factory=lambda: int(time.time()))

    def running_front(self) -> AsyncEngine:
        """The started `AsyncEngine`, or a 503."""
        if self.front is None or not self.front.is_running:
            raise ApiError(503, "the engine is not running", code="unavailable")
        return self.front

    def check_model(self, name: str | None) -> None:
        if name is not None and name not in self.config.model_names:
            raise ApiError(
                404,
                f"the model {name!r} does not exist; this server serves "
                f"{', '.join(map(repr, self.config.model_names))}",
                param="model",
                code="model_not_found",
            )

    def truncate(self, body: TextParams) -> int | None:
        """The call's truncate_prompt_tokens: -1 (the model's limit) under --auto-truncate."""
        if body.truncate_prompt_tokens is None and self.config.auto_truncate:
            return -1
        return body.truncate_prompt_tokens


def get_state(request: HttpRequest) -> ServerState:
    state: ServerState = request.app.state.vecpool
    return state


@dataclass
class Timings:
    """Where one call's time went (seconds), and its size."""

    tokenization: float = 0.0
    queue: float = 0.0
    inference: float = 0.0
    num_inputs: int = 0
    prompt_tokens: int = 0

    def headers(self) -> dict[str, str]:
        return {
            "x-tokenization-time": f"{self.tokenization * 1000:.3f}",
            "x-queue-time": f"{self.queue * 1000:.3f}",
            "x-inference-time": f"{self.inference * 1000:.3f}",
            "x-num-inputs": str(self.num_inputs),
            "x-prompt-tokens": str(self.prompt_tokens),
        }


class _CallTimer:
    """Done callback of a call's requests: when its first step began and its last one ended."""

    def __init__(self, front: AsyncEngine):
        self.front = front
        self.first_step = math.inf
        self.last_done = 0.0

    def __call__(self, request: Request) -> None:
        if request.status in (RequestStatus.FINISHED, RequestStatus.FAILED):
            # Runs in the loop thread, inside the step that finished the request.
            self.first_step = min(self.first_step, self.front.step_started_at)
            self.last_done = max(self.last_done, time.perf_counter())


async def read_body(request: HttpRequest, model: type[M], limit: int) -> M:
    """The JSON body as `model`: 413 past `limit` bytes, 400 for anything malformed."""
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise _too_large(int(length), limit)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise _too_large(size, limit)
        chunks.append(chunk)
    raw = b"".join(chunks)
    if size > _PARSE_INLINE_BYTES:  # a large body (prompt embeds) is parsed off the event loop
        return await asyncio.to_thread(_parse, raw, model)
    return _parse(raw, model)


def _parse(raw: bytes, model: type[M]) -> M:
    try:
        data = json.loads(raw)
    except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError
        raise ApiError(400, f"the body is not valid JSON: {exc}", code="invalid_json") from None
    if not isinstance(data, dict):
        raise ApiError(400, "the body must be a JSON object", code="invalid_json")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        error = exc.errors(include_url=False)[0]
        param = validation_param(tuple(error["loc"]))
        raise ApiError(
            400,
            f"{param}: {error['msg']}" if param else error["msg"],
            param=param,
            code=error["type"],
        ) from None


def _too_large(size: int, limit: int) -> ApiError:
    return ApiError(
        413,
        f"the request body has {size} bytes or more, over the limit of {limit} bytes",
        code="payload_too_large",
    )


async def until_disconnected(request: HttpRequest, work: Awaitable[T]) -> T:
    """Await `work`; if the client disconnects first, cancel it and raise
    `ClientDisconnectedError`. Cancelling the work cancels its engine requests."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    if task in done:
        return task.result()
    raise ClientDisconnectedError()


async def _disconnected(request: HttpRequest) -> None:
    # The body has been read; the next message of an HTTP/1.1 cycle is the disconnect.
    while (await request.receive())["type"] != "http.disconnect":
        pass


def check_embeds_allowed(state: ServerState, items: list[Any], list_name: str = "input") -> None:
    """A 400 for prompt embeds on a server started without --enable-prompt-embeds."""
    if state.engine.inputs.limits.enable_prompt_embeds:
        return
    for i, item in enumerate(items):
        if isinstance(item, EncodedEmbeds):
            raise ApiError(
                400,
                f"{list_name} {i}: prompt embeds are disabled on this server "
                "(start it with --enable-prompt-embeds)",
                param=f"{list_name}[{i}].prompt_embeds",
                code="prompt_embeds_disabled",
            )


def check_count(state: ServerState, n: int, list_name: str = "input") -> None:
    if n > state.config.max_batch_inputs:
        raise ApiError(
            400,
            f"{list_name} has {n} items, more than the limit of "
            f"{state.config.max_batch_inputs} per request",
            param=list_name,
            code="too_many_inputs",
        )


async def run_call(
    state: ServerState,
    request: HttpRequest,
    endpoint: str,
    prepare: Callable[[], PreparedCall[T]],
    num_inputs: int,
    to_api_error: Callable[[InputError], ApiError] = input_error,
) -> tuple[T, Timings]:
    """Prepare a call in the input thread pool (decoding, tokenizing), run its requests on the
    engine, finish it; racing the client's disconnect throughout. `num_inputs` (the requests
    the call will queue) is checked against the free room of the queue first."""
    front = state.running_front()
    _check_queue(front, num_inputs)
    return await until_disconnected(
        request, _run_call(state, front, endpoint, prepare, to_api_error)
    )


async def _run_call(
    state: ServerState,
    front: AsyncEngine,
    endpoint: str,
    prepare: Callable[[], PreparedCall[T]],
    to_api_error: Callable[[InputError], ApiError],
) -> tuple[T, Timings]:
    start = time.perf_counter()
    loop = asyncio.get_running_loop()
    try:
        call = await loop.run_in_executor(state.executor, prepare)
    except InputError as exc:
        raise to_api_error(exc) from None
    submitted = time.perf_counter()
    timer = _CallTimer(front)
    for r in call.requests:
        r.add_done_callback(timer)
        r.add_done_callback(state.metrics.on_request_done)
    try:
        outputs = await front.run(call.requests)
    except QueueFullError as exc:  # the queue filled while we tokenized
        raise _queue_full(str(exc)) from None
    try:
        result = call.finish(outputs)  # raises the first failed input's error
    except InputError as exc:
        raise to_api_error(exc) from None
    except VecpoolError as exc:
        raise ApiError(500, str(exc), code="engine_error") from None
    timings = Timings(
        tokenization=submitted - start,
        num_inputs=len(outputs),
        prompt_tokens=sum(o.num_prompt_tokens for o in outputs),
    )
    if timer.last_done:
        timings.queue = max(0.0, timer.first_step - submitted)
        timings.inference = timer.last_done - timer.first_step
    m = state.metrics
    m.tokenization_seconds.labels(endpoint).observe(timings.tokenization)
    m.queue_seconds.labels(endpoint).observe(timings.queue)
    m.inference_seconds.labels(endpoint).observe(timings.inference)
    m.prompt_tokens.labels(endpoint).inc(timings.prompt_tokens)
    return result, timings


def _check_queue(front: AsyncEngine, n: int) -> None:
    """429 before any tokenization when the queue cannot take `n` more inputs now."""
    if front.num_queued + n > front.max_queued:
        raise _queue_full(
            f"the queue is full ({front.num_queued} of {front.max_queued} inputs waiting)"
        )


def _queue_full(message: str) -> ApiError:
    return ApiError(429, f"{message}; retry later", code="queue_full", headers={"retry-after": "1"})
