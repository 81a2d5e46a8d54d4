"""The outermost layer of the app (pure ASGI): API-key check, request counts and latency."""

from __future__ import annotations

import hmac
import logging
import time

from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from vecpool.server.config import PUBLIC_PATHS
from vecpool.server.errors import ApiError
from vecpool.server.metrics import ServerMetrics

logger = logging.getLogger(__name__)


def error_response(error: ApiError) -> Response:
    return Response(
        error.content(),
        status_code=error.status,
        media_type="application/json",
        headers=error.headers,
    )


class ServerMiddleware:
    """Refuses requests without the API key (401) and records every answer's status and time.

    `endpoints` are the app's paths; any other path is counted as "other", so that probing
    clients cannot grow the metrics without bound.
    """

    def __init__(
        self,
        app: ASGIApp,
        *,
        metrics: ServerMetrics,
        api_key: str | None,
        endpoints: frozenset[str],
    ):
        self.app = app
        self.metrics = metrics
        self.api_key = api_key.encode() if api_key is not None else None
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
            elif message["type"] == "http.response.body" and not message.get("more_body"):
                answered = True
            await send(message)

        try:
            if path not in PUBLIC_PATHS and not self._authorized(scope):
                error = ApiError(
                    401,
                    "a valid API key is required: send the header 'Authorization: Bearer <key>'",
                    code="invalid_api_key",
                    headers={"www-authenticate": "Bearer"},
                )
                await error_response(error)(scope, receive, send_and_record)
            else:
                await self.app(scope, receive, send_and_record)
        except Exception:
            # Answered here, not raised on: the HTTP server would close the keep-alive
            # connection after its 500, under a client that may already be sending its next
            # request on it, and that request would be reset.
            logger.exception("unexpected error answering %s", path)
            if started and not answered:
                raise  # half an answer is out: only closing the connection ends it
            if not started:
                error = ApiError(500, "internal server error", code="internal_error")
                await error_response(error)(scope, receive, send_and_record)
        finally:
            self.metrics.http_requests.labels(endpoint, str(status)).inc()
            self.metrics.http_seconds.labels(endpoint).observe(time.perf_counter() - start)

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
