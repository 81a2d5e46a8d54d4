"""The outermost layer of the app (pure ASGI): what is decided before a body is read.

Health probes are answered here, without the router, the engine or the tokenizer pool; a
request for work is refused here before its body is read or parsed: 503 with `Retry-After`
while no engine runs and one restarts, 429 when the engine's queue already holds more than
`max_queue_wait` seconds of work; then the API-key check;
then request counts and latency for every answer. Any 5xx answer closes its connection
(`connection: close`), so a client never sends its next request on a connection the server
is about to close.
"""

from __future__ import annotations

import hmac
import logging
import math
import time

from starlette.requests import ClientDisconnect
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from vecpool.server.config import PUBLIC_PATHS
from vecpool.server.errors import ApiError
from vecpool.server.metrics import ServerMetrics
from vecpool.server.state import ServerState

logger = logging.getLogger(__name__)

HEALTH_PATHS = frozenset({"/health", "/ping"})  # /ping: SageMaker's
# Not sent to anyone (the client is gone); nginx's code for "client closed request".
STATUS_CLIENT_CLOSED = 499
_CLOSE = (b"connection", b"close")


def error_response(error: ApiError) -> Response:
    return Response(
        error.content(),
        status_code=error.status,
        media_type="application/json",
        headers=error.headers,
    )


class ServerMiddleware:
    """Health probes, early 429s, the API key (401), and every answer's status and time.

    `endpoints` are the app's paths; any other path is counted as "other", so that probing
    clients cannot grow the metrics without bound.
    """

    def __init__(self, app: ASGIApp, *, state: ServerState, endpoints: frozenset[str]):
        self.app = app
        self.state = state
        self.metrics: ServerMetrics = state.metrics
        api_key = state.config.api_key
        self.api_key = api_key.encode() if api_key is not None else None
        self.max_wait = state.config.max_queue_wait
        self.endpoints = endpoints

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        endpoint = path if path in self.endpoints else "other"
        status = 500  # what an exception that escapes the app becomes
        started = answered = False
        start = time.perf_counter()

        async def send_and_record(message: Message) -> None:
            nonlocal status, started, answered
            if message["type"] == "http.response.start":
                status, started = message["status"], True
                if status >= 500:  # the server closes it after this answer: say so
                    message["headers"] = [*message.get("headers", ()), _CLOSE]
            elif message["type"] == "http.response.body" and not message.get("more_body"):
                answered = True
            await send(message)

        try:
            error = self._refusal(scope, path)
            if path in HEALTH_PATHS and scope["method"] in ("GET", "HEAD"):
                await self._health(scope, receive, send_and_record)
            elif error is not None:
                await error_response(error)(scope, receive, send_and_record)
            else:
                await self.app(scope, receive, send_and_record)
        except ClientDisconnect:  # gone while sending its body: nobody to answer
            status = STATUS_CLIENT_CLOSED
            self.metrics.disconnects.labels(endpoint).inc()
        except Exception as exc:
            # Answered here, not raised on: the HTTP server would close the connection
            # without a word, under a client that may already be sending its next request.
            _log_unexpected(path, exc)
            if started and not answered:
                raise  # half an answer is out: only closing the connection ends it
            if not started:
                error = ApiError(500, "internal server error", code="internal_error")
                await error_response(error)(scope, receive, send_and_record)
        finally:
            self.metrics.answered(endpoint, status).inc()
            self.metrics.for_endpoint(endpoint).http_seconds.observe(time.perf_counter() - start)

    def _refusal(self, scope: Scope, path: str) -> ApiError | None:
        """401 without the API key; for work, 503 while every engine restarts and 429 while
        the queue is over its wait bound."""
        if path in PUBLIC_PATHS:
            return None
        if not self._authorized(scope):
            return ApiError(
                401,
                "a valid API key is required: send the header 'Authorization: Bearer <key>'",
                code="invalid_api_key",
                headers={"www-authenticate": "Bearer"},
            )
        client = self.state.client
        if scope["method"] == "POST" and client is not None:
            retry_after = client.retry_after
            if retry_after is not None:
                return ApiError(
                    503,
                    f"{client.health_problem or 'the engine is not running'}; retry later",
                    code="unavailable",
                    headers={"retry-after": str(math.ceil(retry_after))},  # closes, as 5xx do
                )
            wait = client.expected_wait
            if wait > self.max_wait:
                return ApiError(
                    429,
                    f"the queue holds about {wait:.1f} s of work, over the limit of "
                    f"{self.max_wait:g} s; retry later",
                    code="queue_full",
                    # The body is left unread: the connection cannot carry another request.
                    headers={"retry-after": "1", "connection": "close"},
                )
        return None

    async def _health(self, scope: Scope, receive: Receive, send: Send) -> None:
        """200 while every engine runs and answers, 503 naming what is wrong otherwise (with
        data parallel, one engine process gone or stuck); HEAD as GET without the body."""
        client = self.state.client
        problem = "the engine is not running" if client is None else await client.health()
        if problem is None:
            # `unix`: Infinity's answer (the server's clock); the others read the status only.
            body = b'{"status":"ok","unix":%.6f}' % time.time()
            response = Response(body, media_type="application/json")
        else:
            response = error_response(ApiError(503, problem, code="unavailable"))
        await response(scope, receive, send)

    def _authorized(self, scope: Scope) -> bool:
        if self.api_key is None:
            return True
        for name, value in scope["headers"]:
            if name == b"authorization":
                scheme, _, token = value.partition(b" ")
                return scheme.lower() == b"bearer" and hmac.compare_digest(
                    token.strip(), self.api_key
                )
        return False


def _log_unexpected(path: str, exc: Exception) -> None:
    try:
        logger.error("unexpected error answering %s", path, exc_info=exc)
    except RecursionError:  # a traceback too deep to format (a deeply nested body)
        logger.error("unexpected error answering %s: %s", path, type(exc).__name__)
