"""Fetching an image over http(s) under a `MediaPolicy`: only to allowed hosts, each
redirect's target checked again, the body capped while it streams in, the whole response
bounded by the read timeout and the request's deadline (a server dripping bytes is cut off).
Every failure is an `InputError` saying why."""

from __future__ import annotations

import contextlib
import functools
import http.client
import socket
import ssl
import threading
import time
import urllib.parse
from typing import TYPE_CHECKING

from vecpool.errors import InputError
from vecpool.inputs.media_policy import FORMAT_NAMES, describe, host_key

if TYPE_CHECKING:
    from vecpool.inputs.media_policy import MediaPolicy

_REDIRECTS = frozenset({301, 302, 303, 307, 308})
_CHUNK = 1 << 16


# --- URLs -------------------------------------------------------------------------------------


def host_of(url: str) -> str:
    """The host `url` names, for a message ('?' where it names none)."""
    try:
        return urllib.parse.urlsplit(url).hostname or "?"
    except ValueError:
        return "?"


def _checked_url(url: str, policy: MediaPolicy) -> urllib.parse.SplitResult:
    """`url` parsed, refused unless http(s) to an allowed host."""
    try:
        parts = urllib.parse.urlsplit(url)
        parts.port  # noqa: B018  # (parsed lazily: a bad port raises here)
    except ValueError as exc:
        raise InputError(f"a malformed URL ({exc})") from None
    if parts.scheme.lower() not in ("http", "https"):
        raise InputError(
            f"a redirect to a {parts.scheme or 'relative'!s} URL; only http(s) is followed"
        )
    host = host_key(parts.hostname or "")
    if not host:
        raise InputError("a URL without a host")
    if not policy.allowed_media_domains:
        raise InputError(
            f"image URLs are refused ({host}): no host is allowed; start with "
            "--allowed-media-domains to fetch from chosen hosts, or send the image's bytes, "
            "base64 or a data: URI"
        )
    if host not in policy.allowed_media_domains:
        raise InputError(f"the host {host!r} is not among the --allowed-media-domains")
    return parts


def fetch(url: str, policy: MediaPolicy, deadline: float | None) -> bytes:
    """The body of `url`, following up to `policy.max_redirects` redirects (each target's host
    checked again)."""
    for _ in range(policy.max_redirects + 1):
        parts = _checked_url(url, policy)
        location = _get(parts, policy, deadline)
        if isinstance(location, bytes):
            return location
        url = urllib.parse.urljoin(url, location)
    raise InputError(
        f"fetching an image from {host_of(url)}: more than {policy.max_redirects} redirects"
    )


@functools.cache
def _tls_context() -> ssl.SSLContext:
    """The system's trusted certificates, hostnames checked (built once: loading the
    certificates takes milliseconds)."""
    return ssl.create_default_context()


def _abort(sock: socket.socket) -> None:
    """Ends `sock`'s connection now (a blocked read wakes with end of file; the server sees
    it closed), whoever else holds the socket object."""
    with contextlib.suppress(OSError):
        socket.socket.shutdown(sock, socket.SHUT_RDWR)  # below TLS: no closing handshake


def _get(
    parts: urllib.parse.SplitResult, policy: MediaPolicy, deadline: float | None
) -> bytes | str:
    """One GET: the body (bytes), or a redirect's Location (str). The connection is ended
    when this returns or raises, however it ends."""
    host = parts.hostname or ""
    what = f"fetching an image from {host}"
    start = time.monotonic()
    done_by = start + policy.connect_timeout
    cause = f"no connection within {policy.connect_timeout:g} s"
    if deadline is not None:
        if deadline <= start:
            raise InputError(f"{what}: the request's deadline had passed")
        if deadline < done_by:
            done_by, cause = deadline, "the request's deadline passed before a connection"
    address = f"[{host}]" if ":" in host else host  # an IPv6 literal, as http.client takes it
    conn: http.client.HTTPConnection
    if parts.scheme.lower() == "https":
        conn = http.client.HTTPSConnection(
            address, parts.port, timeout=done_by - start, context=_tls_context()
        )
    else:
        conn = http.client.HTTPConnection(address, parts.port, timeout=done_by - start)
    sock: socket.socket | None = None
    watchdog: threading.Timer | None = None
    try:
        conn.connect()
        # The socket itself, kept: http.client lets go of it once a response will close
        # the connection (as every one here does), so `conn.sock` is None from then on.
        sock = conn.sock
        now = time.monotonic()
        done_by = now + policy.read_timeout
        cause = f"no complete response within {policy.read_timeout:g} s"
        if deadline is not None and deadline < done_by:
            done_by, cause = deadline, "the request's deadline passed before the image arrived"
        # Per-read timeouts cannot bound a whole response (a server may send a byte a
        # second); this timer ends the connection at `done_by`, waking any blocked read.
        watchdog = threading.Timer(max(done_by - now, 0.0), _abort, (sock,))
        watchdog.daemon = True
        watchdog.start()
        return _exchange(conn, sock, parts, policy, done_by, what)
    except InputError:
        raise
    except (OSError, http.client.HTTPException) as exc:  # DNS, refused, TLS, cut off
        if isinstance(exc, TimeoutError) or time.monotonic() >= done_by:
            raise InputError(f"{what}: {cause}") from None
        raise InputError(f"{what}: {describe(exc)}") from None
    finally:
        if watchdog is not None:
            watchdog.cancel()
        if sock is not None:
            _abort(sock)
        conn.close()


def _exchange(
    conn: http.client.HTTPConnection,
    sock: socket.socket,
    parts: urllib.parse.SplitResult,
    policy: MediaPolicy,
    done_by: float,
    what: str,
) -> bytes | str:
    target = parts.path or "/"
    if parts.query:
        target = f"{target}?{parts.query}"
    _set_timeout(sock, done_by)
    conn.request(
        "GET",
        target,
        headers={
            "User-Agent": "vecpool",
            "Accept": "image/*",
            "Accept-Encoding": "identity",
            "Connection": "close",
        },
    )
    response = conn.getresponse()
    try:
        return _body(response, sock, policy, done_by, what)
    finally:
        response.close()


def _body(
    response: http.client.HTTPResponse,
    sock: socket.socket,
    policy: MediaPolicy,
    done_by: float,
    what: str,
) -> bytes | str:
    if response.status in _REDIRECTS:
        location = response.getheader("Location")
        if not location:
            raise InputError(f"{what}: a redirect ({response.status}) without a Location")
        return location
    if response.status != 200:
        raise InputError(f"{what}: HTTP {response.status} {response.reason}".rstrip())
    content_type = (response.getheader("Content-Type") or "").lower()
    if content_type.startswith("image/svg"):
        raise InputError(f"{what}: an SVG image, which is not a raster format; send {FORMAT_NAMES}")
    cap = policy.max_image_bytes
    length = response.getheader("Content-Length")
    if length is not None and length.strip().isdigit() and int(length) > cap:
        raise InputError(f"{what}: {int(length):,} bytes, over the limit of {cap:,} bytes")
    chunks: list[bytes] = []
    received = 0
    while True:
        _set_timeout(sock, done_by)
        chunk = response.read1(_CHUNK)
        if not chunk:
            break
        received += len(chunk)
        if received > cap:
            chunks.clear()
            raise InputError(f"{what}: over the limit of {cap:,} bytes")
        chunks.append(chunk)
    if time.monotonic() >= done_by:  # cut off at `done_by`: not the whole body
        raise TimeoutError
    if response.length:  # the connection closed before Content-Length bytes came
        raise InputError(f"{what}: the response ended after {received:,} of {length} bytes")
    return b"".join(chunks)


def _set_timeout(sock: socket.socket, done_by: float) -> None:
    left = done_by - time.monotonic()
    if left <= 0:
        raise TimeoutError
    sock.settimeout(left)
