"""The server as processes: an engine process and API-server processes on one port.

Many single-input clients at once get, each, their own input's vector (within the fp32
rounding of another batching), with no connection error; single inputs queued together run in one engine step (held at a gate while
they queue, so by construction, not by a race against the engine's speed); the engine process's death turns /health to 503 and
fails the calls in flight at once (its restart: `test_restart.py`); the supervisor's death
takes every process with it.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest

import vecpool
from tests.server.conftest import Server, ServerPool, ServerSpec, assert_error
from tests.server.gate import EngineGate

CLIENTS = 64
ROUNDS = 2  # requests each client sends, one after another
# An input batched with others runs through matrix products of other shapes, whose float32
# sums round differently: 2e-7 at most measured on this model; 1e-6 bounds it.
BATCHING_TOLERANCE = 1e-6
WORDS = "cats dogs eat fish bread a man woman runs quickly over under river city".split()


def _texts(n: int) -> list[str]:
    rng = np.random.default_rng(7)
    return [f"{' '.join(rng.choice(WORDS, size=int(rng.integers(2, 30))))} {i}" for i in range(n)]


def _pids(server: Server) -> tuple[int, list[int]]:
    """(engine pid, API pids) from the supervisor's log."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        found = re.search(
            r"engine process \(pid (\d+)\), API-server processes \(pids ([\d, ]+)\)",
            server.log.read_text(),
        )
        if found:
            return int(found[1]), [int(p) for p in found[2].split(", ")]
        time.sleep(0.1)
    raise AssertionError(f"no pids in the log:\n{server.log.read_text()}")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    return not (stat.exists() and stat.read_text().split(")")[-1].split()[0] == "Z")


SERVERS = {
    "two_apis": ServerSpec(
        lambda folder: ["--api-server-count", "2"], log_level="info", gated=True
    ),
    "one_step_server": ServerSpec(
        lambda folder: ["--max-num-seqs", "1"], log_level="info", gated=True
    ),
    "one_process_server": ServerSpec(lambda folder: ["--api-server-count", "0"]),
}


@pytest.fixture(scope="module")
def gate(server_pool: ServerPool, request: pytest.FixtureRequest) -> EngineGate:
    return server_pool.gate(request, "two_apis")


@pytest.fixture(scope="module")
def two_apis(server_pool: ServerPool, request: pytest.FixtureRequest) -> Iterator[Server]:
    srv = server_pool.take(request, "two_apis")
    yield srv
    srv.stop()


@pytest.fixture
def one_step_server(server_pool: ServerPool, request: pytest.FixtureRequest) -> Iterator[Server]:
    """One input per step, behind a gate; its test kills its engine."""
    srv = server_pool.take(request, "one_step_server")
    yield srv
    srv.stop()


@pytest.fixture
def one_process_server(server_pool: ServerPool, request: pytest.FixtureRequest) -> Iterator[Server]:
    srv = server_pool.take(request, "one_process_server")
    yield srv
    srv.stop()


def test_concurrent_single_input_clients(two_apis: Server, minilm: vecpool.Engine) -> None:
    texts = _texts(CLIENTS * ROUNDS)
    # One call of them all here, another batching than the server's: fp32 rounding apart.
    expected = dict(zip(texts, minilm.embed(texts), strict=True))
    answers: list[tuple[str, np.ndarray]] = []
    errors: Counter[str] = Counter()
    before = two_apis.metric("vecpool_engine_steps_total")

    async def client(http: httpx.AsyncClient, first: int) -> None:
        for i in range(first, len(texts), CLIENTS):
            text = texts[i]
            try:
                response = await http.post("/v1/embeddings", json={"input": text})
            except httpx.TransportError as exc:
                errors[type(exc).__name__] += 1
                continue
            if response.status_code != 200:
                errors[f"status {response.status_code}"] += 1
                continue
            vector = np.asarray(response.json()["data"][0]["embedding"], dtype=np.float32)
            answers.append((text, vector))

    async def main() -> None:
        limits = httpx.Limits(max_connections=CLIENTS, max_keepalive_connections=CLIENTS)
        async with httpx.AsyncClient(base_url=two_apis.url, limits=limits, timeout=60) as http:
            await asyncio.gather(*(client(http, i) for i in range(CLIENTS)))

    asyncio.run(main())
    assert errors == Counter()
    assert sorted(text for text, _ in answers) == sorted(texts)  # each answered once
    worst = max(float(np.abs(vector - expected[text]).max()) for text, vector in answers)
    assert worst <= BATCHING_TOLERANCE
    assert two_apis.metric("vecpool_engine_steps_total") > before
    assert two_apis.metric(
        "vecpool_http_requests_total", endpoint="/v1/embeddings", status="200"
    ) >= len(answers)


def test_single_inputs_queued_together_run_in_one_step(
    two_apis: Server, gate: EngineGate, minilm: vecpool.Engine
) -> None:
    """24 clients of one input each, through both API processes, queued while the engine is
    held: the engine runs them in one step, and each gets what its input gives alone."""
    texts = _texts(24)
    answers: dict[str, httpx.Response] = {}

    def post(text: str) -> None:
        answers[text] = httpx.post(
            f"{two_apis.url}/v1/embeddings", json={"input": text}, timeout=60
        )

    clients = [threading.Thread(target=post, args=(text,)) for text in texts]
    before = two_apis.metric("vecpool_engine_steps_total")
    with gate.held():
        for client in clients:
            client.start()
        gate.wait_entered()
        two_apis.wait_for("vecpool_queue_size", lambda v: v == len(texts))
    for client in clients:
        client.join()
    assert two_apis.metric("vecpool_engine_steps_total") - before == 1
    for text in texts:
        assert answers[text].status_code == 200
        vector = np.asarray(answers[text].json()["data"][0]["embedding"], dtype=np.float32)
        assert float(np.abs(vector - minilm.embed([text])[0]).max()) <= BATCHING_TOLERANCE


def test_engine_death_fails_calls_at_once(
    one_step_server: Server, server_pool: ServerPool, request: pytest.FixtureRequest
) -> None:
    """The engine held before its first step (the gate) with a call queued: killed, its call
    fails with 503 while the gate is still closed, so at once by construction (nothing else
    could have answered it); new calls get 503 and the API servers go on."""
    server, gate = one_step_server, server_pool.gate(request, "one_step_server")
    try:
        engine_pid, api_pids = _pids(server)
        long = [101] + [7592] * 254 + [102]
        results: list[httpx.Response] = []

        def slow_call() -> None:
            results.append(server.post("/v1/embeddings", {"input": [long] * 256}))

        thread = threading.Thread(target=slow_call)
        with gate.held():
            thread.start()
            server.wait_for("vecpool_queue_size", lambda v: v == 256)  # queued, none run
            os.kill(server.process.pid, signal.SIGSTOP)  # hold the supervisor: no restart yet
            os.kill(engine_pid, signal.SIGKILL)
            thread.join(timeout=60)
            assert not thread.is_alive()
            (response,) = results
            assert_error(response, 503)
            assert "engine" in response.json()["error"]["message"]
            health = server.client.get("/health")
            assert health.status_code == 503 and health.json()["error"]["code"] == "unavailable"
            assert_error(server.post("/v1/embeddings", {"input": "hello"}), 503)
            assert all(_alive(pid) for pid in api_pids)  # the API servers go on, answering 503
    finally:
        os.kill(server.process.pid, signal.SIGCONT)
        server.stop()
    deadline = time.monotonic() + 30
    while any(_alive(pid) for pid in api_pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_alive(pid) for pid in api_pids)


def test_supervisor_death_takes_every_process(two_apis: Server) -> None:
    """The module's server, after its other tests: its supervisor killed, its engine and
    both API processes go too."""
    server = two_apis
    engine_pid, api_pids = _pids(server)
    assert len(api_pids) == 2 and all(_alive(p) for p in (engine_pid, *api_pids))
    server.client.close()
    server.process.kill()  # SIGKILL: no chance to stop its children itself
    server.process.wait()
    deadline = time.monotonic() + 30
    while any(_alive(p) for p in (engine_pid, *api_pids)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_alive(p) for p in (engine_pid, *api_pids))


def test_one_process_mode(one_process_server: Server, minilm: vecpool.Engine) -> None:
    server = one_process_server
    try:
        response = server.post("/v1/embeddings", {"input": ["one process", "two"]})
        assert response.status_code == 200, response.text
        got = np.array([d["embedding"] for d in response.json()["data"]], dtype=np.float32)
        assert np.abs(got - minilm.embed(["one process", "two"])).max() <= 1e-6
        assert server.metric("vecpool_engine_steps_total") >= 1
    finally:
        server.stop()
