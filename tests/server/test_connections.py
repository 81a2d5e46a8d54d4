"""Connections against a real `vecpool serve`: slow clients are cut at the read timeout while
others are served; connections past the cap are refused at once; a client gone mid-upload is
a 499 without a traceback; SIGTERM lets requests in flight finish, then exits."""

from __future__ import annotations

import resource
import signal
import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tests.server.conftest import Server, start_server

SLOW_CLIENTS = 1000
READ_TIMEOUT = 2.0
MAX_CONNECTIONS = 1100


@pytest.fixture(scope="module")
def guarded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    srv = start_server(
        tmp_path_factory.mktemp("guarded"),
        "--timeout-read",
        str(READ_TIMEOUT),
        "--max-connections",
        str(MAX_CONNECTIONS),
    )
    yield srv
    srv.stop()


def _room_for(files: int) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < files:
        if hard != resource.RLIM_INFINITY and hard < files:
            pytest.skip(f"the open-file limit ({hard}) is below {files}")
        resource.setrlimit(resource.RLIMIT_NOFILE, (files, hard))


def _connect(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=10)


def _until_closed(sock: socket.socket, deadline: float) -> tuple[float, bytes]:
    """When the server closed `sock` (monotonic), and what it sent before."""
    received = b""
    while True:
        sock.settimeout(max(0.01, deadline - time.monotonic()))
        try:
            chunk = sock.recv(4096)
        except (TimeoutError, ConnectionResetError):
            return (time.monotonic() if time.monotonic() < deadline else float("inf")), received
        if not chunk:
            return time.monotonic(), received
        received += chunk


def test_slow_clients_are_closed_at_the_read_timeout(guarded: Server) -> None:
    _room_for(2 * SLOW_CLIENTS + 512)
    started = time.monotonic()
    slow = []
    for _ in range(SLOW_CLIENTS):  # half a request each: the headers never end
        sock = _connect(guarded.url)
        sock.sendall(b"POST /v1/embeddings HTTP/1.1\r\nhost: x\r\ncontent-length: 20\r\n")
        slow.append(sock)
    opened = time.monotonic() - started
    # Others are served meanwhile, at once.
    t = time.perf_counter()
    response = guarded.post("/v1/embeddings", {"input": "still served"})
    served = time.perf_counter() - t
    assert response.status_code == 200 and served < 1.0
    deadline = time.monotonic() + READ_TIMEOUT + 10
    with ThreadPoolExecutor(32) as pool:
        closed = list(pool.map(lambda s: _until_closed(s, deadline), slow))
    for sock in slow:
        sock.close()
    times = [when - started for when, _ in closed]
    assert max(times) < opened + READ_TIMEOUT + 3, f"the last closed after {max(times):.1f} s"
    assert min(times) >= READ_TIMEOUT * 0.9
    assert all(data.startswith(b"HTTP/1.1 408") for _, data in closed)
    print(
        f"{SLOW_CLIENTS} slow clients opened in {opened:.2f} s, closed at "
        f"{min(times):.2f}-{max(times):.2f} s; a request meanwhile took {served * 1000:.0f} ms"
    )
    assert guarded.alive()


def test_connections_past_the_cap_are_refused_at_once(guarded: Server) -> None:
    _room_for(MAX_CONNECTIONS + 600)
    idle = [_connect(guarded.url) for _ in range(MAX_CONNECTIONS + 50)]
    try:
        deadline = time.monotonic() + 3
        refused = 0
        for sock in idle[-60:]:
            when, data = _until_closed(sock, min(deadline, time.monotonic() + 0.3))
            refused += data.startswith(b"HTTP/1.1 503") and when < float("inf")
        assert refused >= 40, refused
    finally:
        for sock in idle:
            sock.close()
    time.sleep(0.2)
    assert guarded.alive()


def test_a_client_gone_mid_upload_is_a_499_without_traceback(guarded: Server) -> None:
    before = guarded.metric("vecpool_client_disconnects_total", endpoint="/v1/embeddings")
    for _ in range(3):
        sock = _connect(guarded.url)
        sock.sendall(
            b"POST /v1/embeddings HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            b'content-length: 100000\r\n\r\n{"input": "abc'
        )
        time.sleep(0.2)
        sock.close()
    guarded.wait_for(
        "vecpool_client_disconnects_total", lambda v: v >= before + 3, endpoint="/v1/embeddings"
    )
    log = guarded.log.read_text()
    assert "Traceback" not in log and "500" not in log, log[-2000:]
    assert guarded.alive()


def test_sigterm_drains_requests_in_flight(tmp_path: Path) -> None:
    """Requests in flight when SIGTERM arrives are answered; the server exits within its
    grace period."""
    grace = 20
    # The queue's wait bound off: this test is about the drain, on a machine of any speed.
    srv = start_server(tmp_path, "--shutdown-timeout", str(grace), "--max-queue-wait", "1000")
    body = {"input": [f"passage {i} " + "word " * 120 for i in range(48)]}
    results: list[int] = []

    def send() -> None:
        with httpx.Client(timeout=60) as client:
            results.append(client.post(f"{srv.url}/v1/embeddings", json=body).status_code)

    try:
        threads = [threading.Thread(target=send) for _ in range(4)]
        for thread in threads:
            thread.start()
        srv.wait_for("vecpool_queue_size", lambda v: v >= 48)  # in the engine
        signalled = time.monotonic()
        srv.process.send_signal(signal.SIGTERM)
        for thread in threads:
            thread.join(60)
        srv.process.wait(grace + 10)
        exited = time.monotonic() - signalled
    finally:
        if srv.process.poll() is None:
            srv.stop()
    assert results == [200] * 4, results
    assert srv.process.returncode == 0
    assert exited < grace
    print(f"4 requests of 48 passages drained; exited {exited:.1f} s after SIGTERM")
