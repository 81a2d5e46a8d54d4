"""Connection limits below the app, in uvicorn's HTTP protocol: a read deadline per request and
a cap on open connections, and the open-file limit they need.

uvicorn has no read timeout: a client that sends half a request (or nothing) holds its
connection, and a file descriptor, for as long as it likes; enough of them exhaust the
process's open files and nobody else is accepted. Here every request must arrive whole (its
headers and body) within `read_timeout` seconds of its first byte (of the connection, for a
new one), or it is answered 408 and closed; and a connection past `max_connections` is
answered 503 and closed as soon as it is accepted. Both are decided per connection event, so
a request that arrives in time costs one timer and nothing per byte.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

logger = logging.getLogger("vecpool.server")

_TIMEOUT = (
    b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\nconnection: close\r\n"
    b"content-length: %d\r\n\r\n%s"
)
_FULL = (
    b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
    b"connection: close\r\nretry-after: 1\r\ncontent-length: %d\r\n\r\n%s"
)
_TIMEOUT_BODY = (
    b'{"error":{"message":"the request did not arrive whole within the read timeout",'
    b'"type":"invalid_request_error","param":null,"code":"request_timeout"}}'
)
_FULL_BODY = (
    b'{"error":{"message":"the server has as many connections open as it accepts; retry '
    b'later","type":"server_error","param":null,"code":"too_many_connections"}}'
)
# File descriptors a server process needs beside its connections (the model, sockets, pipes).
FD_RESERVE = 256


def guarded_protocol(read_timeout: float, max_connections: int) -> type[asyncio.Protocol]:
    """uvicorn's httptools protocol with a read deadline and a connection cap."""
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    class GuardedProtocol(HttpToolsProtocol):
        _read_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            if len(self.connections) > max_connections:
                transport.write(_FULL % (len(_FULL_BODY), _FULL_BODY))
                transport.close()
                return
            self._arm()

        def data_received(self, data: bytes) -> None:
            if self._read_timer is None and (self.cycle is None or self.cycle.response_complete):
                self._arm()  # the first byte of the next request on a kept-alive connection
            super().data_received(data)

        def on_message_complete(self) -> None:
            self._disarm()
            super().on_message_complete()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self) -> None:
            self._read_timer = self.loop.call_later(read_timeout, self._on_read_timeout)

        def _disarm(self) -> None:
            if self._read_timer is not None:
                self._read_timer.cancel()
                self._read_timer = None

        def _on_read_timeout(self) -> None:
            self._read_timer = None
            if self.transport.is_closing():
                return
            if (
                self.cycle is None
                or self.cycle.response_complete
                or not (self.cycle.response_started)
            ):
                self.transport.write(_TIMEOUT % (len(_TIMEOUT_BODY), _TIMEOUT_BODY))
            self.transport.close()

    return GuardedProtocol


def raise_open_file_limit(max_connections: int) -> int:
    """Raise this process's soft open-file limit (children inherit it) toward what
    `max_connections` needs, as far as the hard limit allows; the connections that fit."""
    try:
        import resource
    except ImportError:  # not on this platform: nothing to raise
        return max_connections
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    needed = max_connections + FD_RESERVE
    if soft != resource.RLIM_INFINITY and soft < needed:
        target = needed if hard == resource.RLIM_INFINITY else min(needed, hard)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError) as exc:
            logger.warning("cannot raise the open-file limit to %d: %s", target, exc)
    if soft != resource.RLIM_INFINITY and soft < needed:
        fit = max(1, soft - FD_RESERVE)
        logger.warning(
            "the open-file limit is %d (hard %d): --max-connections lowered from %d to %d",
            soft,
            hard,
            max_connections,
            fit,
        )
        return fit
    return max_connections


def uvicorn_limits(read_timeout: float, max_connections: int) -> dict[str, Any]:
    """uvicorn.Config's keyword arguments for these limits."""
    return {"http": guarded_protocol(read_timeout, max_connections)}
