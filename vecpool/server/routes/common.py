"""What every endpoint does: read the body, run one call, answer JSON.

A call goes: read and validate the body → check the model name and the counts → prepare the
call (decode and tokenize, off the event loop) → run its requests on the engine client → wait,
racing the client's disconnect (which cancels the call's requests, so waiting ones never run)
→ finish it → timings.

A call with images is prepared in its own thread pool (`ServerState.media_executor`), whatever
its size: reading an image may wait on a URL, and decodes and resizes pixels; a slow host then
holds a media thread, never the event loop or the tokenizer threads that text calls use. Its
URL fetches end at the request's deadline (`x-request-timeout`), when it has one.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import msgspec
import numpy as np
from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect
from starlette.requests import Request as HttpRequest
from starlette.responses import Response

from vecpool.calls import CallContext, PreparedCall
from vecpool.calls.outputs import PromptRequest, RunTimes
from vecpool.errors import EngineDeadError, InputError, QueueFullError, VecpoolError
from vecpool.server.codec import carries_images, encode_array, to_bytes
from vecpool.server.errors import (
    ApiError,
    BodyError,
    ClientDisconnectedError,
    input_error,
    validation_param,
)
from vecpool.server.protocol import OutputParams
from vecpool.server.state import EngineClient, ServerState, unavailable

M = TypeVar("M", bound=BaseModel)
T = TypeVar("T")
_PARSE_INLINE_BYTES = 64 * 1024
# A call whose body is this small is prepared on the event loop: tokenizing a few short texts
# takes tens of microseconds, less than the hop to a thread and back (which, under load, also
# queues behind other calls and contends for the interpreter). Larger ones go to the pool.
_PREPARE_INLINE_BYTES = 16 * 1024
# Outputs of this many values or fewer are encoded on the event loop, larger ones in a thread.
_RENDER_INLINE_VALUES = 16 * 1024
_JSON = msgspec.json.Encoder()
# A client's deadline for its request, in seconds: past it, the request is dropped (408).
TIMEOUT_HEADER = "x-request-timeout"


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

    def usage(self) -> dict[str, int]:
        return {"prompt_tokens": self.prompt_tokens, "total_tokens": self.prompt_tokens}


def json_response(content: bytes, headers: dict[str, str] | None = None) -> Response:
    return Response(content, media_type="application/json", headers=headers)


def dumps(body: Any) -> bytes:
    """`body` as compact JSON, through msgspec: a response's vector of 1,024 floats in ~40 µs,
    where the standard library takes ~600. Its floats are finite: the engine fails an output
    that is not, and `encode_array` refuses one that overflows a narrower `embed_dtype`
    (msgspec would write null where `json` refused)."""
    return _JSON.encode(body)


def response_id(prefix: str) -> str:
    """A response's id: `prefix`, then 32 random hex digits (a random UUID's length)."""
    return f"{prefix}-{os.urandom(16).hex()}"


def render_vectors(
    vectors: list[np.ndarray],
    body: OutputParams,
    timings: Timings,
    *,
    prefix: str,
    item_object: str,
    key: str,
    model: str,
) -> Response:
    """The OpenAI list shape of one vector (or one `[n, dim]` array) per input; with
    `encoding_format` bytes / bytes_only, vLLM's: the body is every vector's bytes in input
    order, and (bytes) the `metadata` header the JSON of where each lies and its shape."""
    headers = timings.headers()
    if body.encoding_format in ("bytes", "bytes_only"):
        chunks: list[bytes] = []
        items: list[dict[str, Any]] = []
        offset = 0
        for index, vector in enumerate(vectors):
            raw = to_bytes(vector, body.embed_dtype, body.endianness)
            items.append(
                {
                    "index": index,
                    "embed_dtype": body.embed_dtype
                    if vector.dtype.kind == "f"
                    else str(vector.dtype),
                    "endianness": body.endianness,
                    "start": offset,
                    "end": offset + len(raw),
                    "shape": list(vector.shape),
                }
            )
            chunks.append(raw)
            offset += len(raw)
        if body.encoding_format == "bytes":
            metadata = {
                "id": response_id(prefix),
                "created": int(time.time()),
                "model": model,
                "data": items,
                "usage": timings.usage(),
            }
            headers["metadata"] = json.dumps(metadata, separators=(",", ":"))
        return Response(b"".join(chunks), media_type="application/octet-stream", headers=headers)
    data = []
    for index, vector in enumerate(vectors):
        value = encode_array(vector, body.encoding_format, body.embed_dtype, body.endianness)
        if vector.size > _RENDER_INLINE_VALUES and body.encoding_format == "float":
            # Encoded alone, then copied in: one encoding of a whole large answer holds the
            # interpreter throughout, stalling the event loop (190 MB of per-token vectors:
            # 0.6 s; encoded a vector at a time, 0.12 s, and 25% sooner done).
            value = msgspec.Raw(_JSON.encode(value))
        item: dict[str, Any] = {"object": item_object, "index": index, key: value}
        if body.encoding_format == "base64" and vector.ndim > 1:
            item["shape"] = list(vector.shape)
        data.append(item)
    return list_answer(prefix, data, model, timings, headers)


def list_answer(
    prefix: str,
    data: list[Any],
    model: str,
    timings: Timings,
    headers: dict[str, str] | None = None,
) -> Response:
    """OpenAI's and vLLM's list answer: `data`, with an id of `prefix`, the time, the model
    and the usage (`headers`: the timings' unless given)."""
    content = {
        "id": response_id(prefix),
        "object": "list",
        "created": int(time.time()),
        "model": model,
        "data": data,
        "usage": timings.usage(),
    }
    return json_response(dumps(content), timings.headers() if headers is None else headers)


async def read_body(request: HttpRequest, model: type[M], limit: int) -> M:
    """The JSON body as `model`: 413 past `limit` bytes, 400 for anything malformed."""
    return validate(model, await read_json(request, limit))


async def read_json(request: HttpRequest, limit: int) -> dict[str, Any]:
    """The JSON object of the body: 415 unless sent as JSON, 413 past `limit` bytes, 400
    unless one JSON object in UTF-8 without duplicate keys. Routes that take several body
    shapes read it so, then `validate` the shape its keys name."""
    _check_content_type(request.headers.get("content-type"))
    _check_content_encoding(request.headers.get("content-encoding"))
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise _too_large(int(length), limit)
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise _too_large(size, limit)
            chunks.append(chunk)
    except ClientDisconnect:  # gone mid-upload: a 499, not an error of ours
        raise ClientDisconnectedError() from None
    raw = b"".join(chunks)
    if size > _PARSE_INLINE_BYTES:  # a large body (prompt embeds) is parsed off the event loop
        return await asyncio.to_thread(_parse_json, raw)
    return _parse_json(raw)


def _check_content_type(value: str | None) -> None:
    """415 for a body sent as anything but JSON (none said is taken as JSON, as curl sends)."""
    if value is None:
        return
    media = value.partition(";")[0].strip().lower()
    if media and media != "application/json" and not media.endswith("+json"):
        raise ApiError(
            415,
            f"the body must be sent as 'content-type: application/json', not {media!r}",
            code="unsupported_media_type",
        )


def _check_content_encoding(value: str | None) -> None:
    """415 for a compressed body (read as it is, it would be refused as not JSON, or worse,
    taken as JSON when its coding left it so)."""
    if value is not None and value.strip().lower() not in ("", "identity"):
        raise ApiError(
            415,
            f"the body must be sent uncompressed, not with 'content-encoding: {value.strip()}'",
            code="unsupported_media_type",
        )


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """An object's pairs as a dict; a 400 for a key given twice (which one would win?) or
    one that is not valid Unicode (a lone surrogate, which JSON's escapes allow)."""
    for key, _ in pairs:
        if not key.isascii():
            _check_key(key)
    data = dict(pairs)
    if len(data) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise ApiError(
                    400,
                    f"the body has the key {key!r} twice in one object",
                    param=key,
                    code="invalid_json",
                )
            seen.add(key)
    return data


def _check_key(key: str) -> None:
    try:
        key.encode("utf-8")
    except UnicodeEncodeError:
        shown = key.encode("utf-8", "backslashreplace").decode("utf-8")
        raise ApiError(
            400,
            f"the body has the key {shown!r}, which is not valid Unicode (a lone surrogate)",
            param=shown,
            code="invalid_json",
        ) from None


_DECODER = json.JSONDecoder(object_pairs_hook=_unique_keys)


def _parse_json(raw: bytes) -> dict[str, Any]:
    if raw[:3] == b"\xef\xbb\xbf" or raw[:2] in (b"\xff\xfe", b"\xfe\xff") or b"\x00" in raw[:4]:
        raise ApiError(
            400,
            "the body must be JSON in UTF-8 without a byte order mark",
            code="invalid_json",
        )
    try:
        # As `json.loads` reads UTF-8 bytes (which the checks above leave the only encoding
        # possible), with one decoder for every body rather than one made per call.
        data = _DECODER.decode(raw.decode("utf-8", "surrogatepass"))
    except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError
        raise ApiError(400, f"the body is not valid JSON: {exc}", code="invalid_json") from None
    except RecursionError:
        raise ApiError(400, "the body is nested too deeply", code="invalid_json") from None
    if not isinstance(data, dict):
        raise ApiError(400, "the body must be a JSON object", code="invalid_json")
    return data


def validate(model: type[M], data: dict[str, Any]) -> M:
    """`data` as `model`, or a 400 naming the first field that is wrong."""
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        error = exc.errors(include_url=False)[0]
        param = validation_param(tuple(error["loc"]))
        raise BodyError(
            f"{param}: {error['msg']}" if param else error["msg"],
            param=param,
            kind=error["type"],
            value=error.get("input"),
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
    # The watcher's end (a disconnect) cancels the work; cheaper than `asyncio.wait` on both,
    # which sets up and takes down a waiter and two callbacks per request.
    watcher.add_done_callback(lambda w: w.cancelled() or task.cancel())
    try:
        return await task
    except asyncio.CancelledError:
        if watcher.done() and not watcher.cancelled():  # the client left: not our cancel
            raise ClientDisconnectedError() from None
        raise
    finally:
        watcher.cancel()
        if not task.done():  # this coroutine was cancelled: the work goes with it
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


async def _disconnected(request: HttpRequest) -> None:
    # The body has been read; the next message of an HTTP/1.1 cycle is the disconnect.
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _small(request: HttpRequest) -> bool:
    length = request.headers.get("content-length")
    return length is not None and length.isdigit() and int(length) <= _PREPARE_INLINE_BYTES


async def off_loop(
    state: ServerState, request: HttpRequest, fn: Callable[[], T], *, media: bool = False
) -> T:
    """`fn()` (decoding, tokenizing): on the event loop for a small body, else in the input
    thread pool; with `media` (the call reads images), always in the media thread pool."""
    if media:
        return await asyncio.get_running_loop().run_in_executor(state.media_executor, fn)
    if _small(request):
        return fn()
    return await asyncio.get_running_loop().run_in_executor(state.executor, fn)


async def in_executor(
    state: ServerState, request: HttpRequest, fn: Callable[[], T], list_name: str = "input"
) -> T:
    """`fn()` off the event loop unless the body is small (`off_loop`), its `InputError` as
    a 400."""
    try:
        return await off_loop(state, request, fn)
    except InputError as exc:
        raise input_error(exc, list_name) from None


async def answer_vectors(
    vectors: list[np.ndarray], body: OutputParams, timings: Timings, **layout: str
) -> Response:
    """`render_vectors` (its `layout`: prefix, item_object, key, model): on the event loop
    when the vectors are small, else in a thread (encoding a large answer holds the
    interpreter)."""
    if sum(v.size for v in vectors) <= _RENDER_INLINE_VALUES:
        return render_vectors(vectors, body, timings, **layout)
    return await asyncio.to_thread(render_vectors, vectors, body, timings, **layout)


async def run_call(
    state: ServerState,
    request: HttpRequest,
    endpoint: str,
    prepare: Callable[[], PreparedCall[T]],
    num_inputs: int,
    to_api_error: Callable[[InputError], ApiError] = input_error,
    *,
    per_token: bool = False,
    media: bool = False,
) -> tuple[T, Timings]:
    """Prepare a call in the input thread pool (decoding, tokenizing), run its requests on the
    engine, finish it; racing the client's disconnect throughout. `num_inputs` (the requests
    the call will queue) is checked against the free room of the queue first. `per_token`: the
    answer holds each token's row, so its size is checked once the call is tokenized
    (`check_answer_size`). `media`: the call reads images (`prepare` uses `call_context`'s
    context): prepared in the media thread pool."""
    deadline = request_deadline(request)
    client = state.running_client()
    _check_queue(client, num_inputs)
    work = _run_call(state, client, request, endpoint, prepare, to_api_error, per_token, media)
    if deadline is not None:
        work = _within(deadline, work, request)
    return await until_disconnected(request, work)


async def run_call_of(
    state: ServerState,
    request: HttpRequest,
    inputs: list[Any],
    prepare: Callable[[CallContext], PreparedCall[T]],
    to_api_error: Callable[[InputError], ApiError] = input_error,
    *,
    per_token: bool = False,
) -> tuple[T, Timings]:
    """`run_call` at the request's path of the call `prepare` makes in its context, one
    request per item of `inputs`: where they carry images (`carries_images`), the context's
    fetches end at the request's deadline (`call_context`) and it is prepared in the media
    thread pool."""
    media = carries_images(inputs)
    ctx = call_context(state, request, media)
    return await run_call(
        state,
        request,
        request.scope["path"],
        lambda: prepare(ctx),
        len(inputs),
        to_api_error,
        per_token=per_token,
        media=media,
    )


def call_context(state: ServerState, request: HttpRequest, media: bool) -> CallContext:
    """The context a call is prepared with: for a call that reads images (`media`), one whose
    URL fetches end at the request's deadline."""
    return state.context.until(request_deadline(request)) if media else state.context


_DEADLINE = "vecpool.deadline"  # the request's deadline, in its ASGI scope once computed


def request_deadline(request: HttpRequest) -> float | None:
    """The `time.monotonic()` moment the client's `x-request-timeout` ends, counted from the
    first time it is asked (once the body is read); None without the header. One value per
    request: the image fetches and the wait on the engine end together."""
    scope = request.scope
    if _DEADLINE not in scope:
        timeout = request_timeout(request)
        scope[_DEADLINE] = None if timeout is None else time.monotonic() + timeout
    deadline: float | None = scope[_DEADLINE]
    return deadline


def request_timeout(request: HttpRequest) -> float | None:
    """The client's deadline in seconds (header `x-request-timeout`), or None."""
    value = request.headers.get(TIMEOUT_HEADER)
    if value is None:
        return None
    try:
        seconds = float(value)
    except ValueError:
        seconds = math.nan
    if not 0 < seconds < math.inf:
        raise ApiError(
            400,
            f"{TIMEOUT_HEADER} must be a positive number of seconds, got {value!r}",
            param=TIMEOUT_HEADER,
            code="invalid_header",
        )
    return seconds


async def _within(deadline: float, work: Awaitable[T], request: HttpRequest) -> T:
    """`work`, cancelled (its waiting requests dropped from the queue) at `deadline` (a
    `time.monotonic()` value)."""
    try:
        async with asyncio.timeout(deadline - time.monotonic()):
            return await work
    except TimeoutError:
        raise _deadline_exceeded(request) from None


def _deadline_exceeded(request: HttpRequest) -> ApiError:
    return ApiError(
        408,
        f"the request was not done within its {TIMEOUT_HEADER} of "
        f"{request_timeout(request):g} s; its inputs were dropped",
        code="deadline_exceeded",
    )


async def _run_call(
    state: ServerState,
    client: EngineClient,
    request: HttpRequest,
    endpoint: str,
    prepare: Callable[[], PreparedCall[T]],
    to_api_error: Callable[[InputError], ApiError],
    per_token: bool,
    media: bool,
) -> tuple[T, Timings]:
    start = time.perf_counter()
    try:
        call = await off_loop(state, request, prepare, media=media)
    except InputError as exc:
        deadline = request_deadline(request)
        if deadline is not None and time.monotonic() >= deadline:  # an image fetch cut off
            raise _deadline_exceeded(request) from None
        raise to_api_error(exc) from None
    if per_token:
        check_answer_size(state, call.requests)
    prepared = time.perf_counter()
    times = RunTimes()
    try:
        outputs = await client.run(call.requests, times)
    except QueueFullError as exc:  # the queue filled while we tokenized
        raise _queue_full(str(exc)) from None
    except EngineDeadError as exc:  # the engine process exited: fail now, do not hang
        raise unavailable(client, f"the engine is not running: {exc}") from None
    try:
        result = call.finish(outputs)  # raises the first failed input's error
    except InputError as exc:
        raise to_api_error(exc) from None
    except VecpoolError as exc:
        raise ApiError(500, str(exc), code="engine_error") from None
    timings = Timings(
        tokenization=prepared - start,
        queue=times.queue,
        inference=times.inference,
        num_inputs=len(outputs),
        prompt_tokens=sum(o.num_prompt_tokens for o in outputs),
    )
    m = state.metrics.for_endpoint(endpoint)
    m.tokenization_seconds.observe(timings.tokenization)
    m.queue_seconds.observe(timings.queue)
    m.inference_seconds.observe(timings.inference)
    m.prompt_tokens.inc(timings.prompt_tokens)
    return result, timings


# The tasks whose answer holds a row per token (`check_answer_size`).
PER_TOKEN = frozenset({"token_embed", "token_classify"})


def check_answer_size(state: ServerState, requests: list[PromptRequest]) -> None:
    """A 400 before it runs for a call whose per-token answer would hold more values than
    `max_answer_values` (each token's row: `token_output_dim` values, or `num_labels`). Such
    an answer grows with tokens times width, not with the body: 2,048 inputs of 512 tokens at
    384 values a token are 403M values, gigabytes once encoded, in one API process."""
    info, limit = state.info, state.config.max_answer_values
    values = sum(
        r.prompt.num_tokens
        * (info.num_labels if r.params.task == "token_classify" else info.token_output_dim)
        for r in requests
    )
    if values > limit:
        raise ApiError(
            400,
            f"the answer would hold about {values:,} values (each input's tokens times a "
            f"token's width), over the server's limit of {limit:,} "
            "(--max-answer-values): send fewer or shorter inputs per request",
            code="answer_too_large",
        )


def _check_queue(client: EngineClient, n: int) -> None:
    """429 before any tokenization when the queue cannot take `n` more inputs now."""
    if client.num_queued + n > client.max_queued:
        raise _queue_full(
            f"the queue is full ({client.num_queued} of {client.max_queued} inputs waiting)"
        )


def _queue_full(message: str) -> ApiError:
    return ApiError(429, f"{message}; retry later", code="queue_full", headers={"retry-after": "1"})
