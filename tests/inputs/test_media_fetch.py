"""vecpool.inputs.media_fetch: images at http(s) URLs, served by a local HTTP server in a
thread; every URL refused for its reason (hosts, redirects, caps, timeouts, the deadline) with
an InputError that names it.

Each fetch runs under `within`, a hang guard: it fails the test if the call has not returned
after a few seconds. Nothing else about time is asserted."""

from __future__ import annotations

import http.server
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from tests.inputs.media_data import HANG_GUARD_S, PNG, RGB, SVG, pixels, within
from vecpool.errors import InputError
from vecpool.inputs.media import MediaPolicy, load_image

CAP = 50_000  # the byte cap of the URL tests' policy
HUNG_UP: list[str] = []  # the paths whose client went away while they were being sent


class Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.0"

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def send(self, status: int, body: bytes = b"", **headers: str) -> None:
        self.send_response(status)
        for name, value in headers.items():
            self.send_header(name.replace("_", "-"), value)
        if "Content_Length" not in headers:
            self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        try:
            self.route(self.path)
        except OSError:  # a client that hung up, as the tests make them
            HUNG_UP.append(self.path)

    def route(self, path: str) -> None:
        if path == "/cat.png":
            self.send(200, PNG, Content_Type="image/png")
        elif path.startswith("/hop/"):  # /hop/N redirects N times, then serves the image
            hops = int(path.rsplit("/", 1)[1])
            location = f"/hop/{hops - 1}" if hops > 1 else "/cat.png"
            self.send(302, Location=location)
        elif path == "/loop":
            self.send(302, Location="/loop")
        elif path == "/absolute-hop":
            self.send(301, Location=f"http://127.0.0.1:{self.server.server_address[1]}/cat.png")
        elif path == "/to-other-host":
            self.send(302, Location="http://elsewhere.invalid/cat.png")
        elif path == "/to-file":
            self.send(307, Location="file:///etc/passwd")
        elif path == "/no-location":
            self.send(302)
        elif path == "/svg":
            self.send(200, SVG, Content_Type="image/svg+xml; charset=utf-8")
        elif path == "/svg-as-png":
            self.send(200, SVG, Content_Type="image/png")
        elif path == "/html":
            self.send(200, b"<html><body>no image here</body></html>", Content_Type="text/html")
        elif path == "/missing":
            self.send(404, b"not found")
        elif path == "/large":  # Content-Length over the cap: refused before the body
            self.send(200, b"", Content_Length=str(CAP + 1))
        elif path == "/large-stream":  # no Content-Length: refused while it streams
            self.send_response(200)
            self.end_headers()
            for _ in range(20):
                self.wfile.write(bytes(10_000))
        elif path == "/short":  # says 1000 bytes, sends 100
            self.send(200, PNG[:100], Content_Length="1000")
        elif path == "/slow":  # headers after 3 s
            time.sleep(3)
            self.send(200, PNG)
        elif path == "/drip":  # a byte every 50 ms: each read on time, the whole never
            self.send_response(200)
            self.send_header("Content-Length", str(len(PNG)))
            self.end_headers()

            for i in range(100):
                self.wfile.write(PNG[i : i + 1])
                self.wfile.flush()
                time.sleep(0.05)
        else:
            self.send(500)


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


def web(**options: Any) -> MediaPolicy:
    settings: dict[str, Any] = {"max_image_bytes": CAP, "read_timeout": 0.5} | options
    return MediaPolicy(allowed_media_domains=("127.0.0.1",), **settings)


def test_url_fetch(server: str) -> None:
    for path in ("/cat.png", "/hop/3", "/absolute-hop", "/cat.png\n"):
        image = within(load_image, server + path, web())
        np.testing.assert_array_equal(pixels(image), pixels(RGB))
    # the host is matched case aside
    upper = within(load_image, server.replace("http", "HTTP") + "/cat.png", web())
    np.testing.assert_array_equal(pixels(upper), pixels(RGB))


def test_urls_refused_without_allowed_hosts(server: str) -> None:
    with pytest.raises(InputError, match=r"image URLs are refused.*--allowed-media-domains"):
        within(load_image, server + "/cat.png", MediaPolicy())
    other = MediaPolicy(allowed_media_domains=("images.example.com",))
    with pytest.raises(InputError, match=r"'127.0.0.1' is not among the --allowed-media-domains"):
        within(load_image, server + "/cat.png", other)
    # an allowed name as the user part of the URL does not make its host allowed
    with pytest.raises(InputError, match=r"'127.0.0.1' is not among"):
        within(load_image, server.replace("//", "//images.example.com@") + "/cat.png", other)


def test_redirects_are_counted_and_checked(server: str) -> None:
    with pytest.raises(InputError, match=r"more than 3 redirects"):
        within(load_image, server + "/hop/4", web())
    with pytest.raises(InputError, match=r"more than 3 redirects"):
        within(load_image, server + "/loop", web())
    with pytest.raises(InputError, match=r"more than 0 redirects"):
        within(load_image, server + "/hop/1", web(max_redirects=0))
    with pytest.raises(InputError, match=r"'elsewhere.invalid' is not among the --allowed-media"):
        within(load_image, server + "/to-other-host", web())
    with pytest.raises(InputError, match=r"a redirect to a file URL; only http"):
        within(load_image, server + "/to-file", web())
    with pytest.raises(InputError, match=r"a redirect \(302\) without a Location"):
        within(load_image, server + "/no-location", web())


def test_url_failures(server: str) -> None:
    with pytest.raises(InputError, match=r"from 127.0.0.1: HTTP 404"):
        within(load_image, server + "/missing", web())
    with pytest.raises(InputError, match=r"SVG"):
        within(load_image, server + "/svg", web())
    with pytest.raises(InputError, match=r"SVG"):
        within(load_image, server + "/svg-as-png", web())
    with pytest.raises(InputError, match=r"not an image in a supported format"):
        within(load_image, server + "/html", web())
    with pytest.raises(InputError, match=rf"{CAP + 1:,} bytes, over the limit of {CAP:,} bytes"):
        within(load_image, server + "/large", web())
    with pytest.raises(InputError, match=rf"over the limit of {CAP:,} bytes"):
        within(load_image, server + "/large-stream", web())
    with pytest.raises(InputError, match=r"the response ended after 100 of 1000 bytes"):
        within(load_image, server + "/short", web())


def test_a_closed_port_is_an_input_error() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # bound, not listening: connections are refused
        with pytest.raises(
            InputError, match=r"fetching an image from 127.0.0.1: ConnectionRefused"
        ):
            within(load_image, f"http://127.0.0.1:{port}/cat.png", web())


def test_slow_responses_time_out(server: str) -> None:
    with pytest.raises(InputError, match=r"no complete response within 0.5 s"):
        within(load_image, server + "/slow", web())
    # each byte comes in time; the whole response does not
    with pytest.raises(InputError, match=r"no complete response within 0.5 s"):
        within(load_image, server + "/drip", web())


def test_the_deadline_bounds_a_fetch(server: str) -> None:
    patient = web(read_timeout=60.0)
    with pytest.raises(InputError, match=r"deadline passed before the image arrived"):
        within(load_image, server + "/slow", patient, deadline=time.monotonic() + 0.3)
    with pytest.raises(InputError, match=r"deadline passed before the image arrived"):
        within(load_image, server + "/drip", patient, deadline=time.monotonic() + 0.3)
    with pytest.raises(InputError, match=r"deadline had passed"):
        within(load_image, server + "/cat.png", patient, deadline=time.monotonic() - 1)
    image = within(load_image, server + "/cat.png", patient, deadline=time.monotonic() + 30)
    np.testing.assert_array_equal(pixels(image), pixels(RGB))


def test_a_fetch_cut_off_closes_its_connection(server: str) -> None:
    """The server sees the connection closed once the fetch gives up, while its error is
    still held (as a caller holds a failed input's error until it answers)."""
    before = HUNG_UP.count("/drip")
    with pytest.raises(InputError, match=r"no complete response") as caught:
        within(load_image, server + "/drip", web())
    guard = time.monotonic() + HANG_GUARD_S
    while HUNG_UP.count("/drip") == before:
        assert time.monotonic() < guard, "the dripping server's client never went away"
        time.sleep(0.01)
    assert caught.value.reason.startswith("fetching an image from 127.0.0.1")
