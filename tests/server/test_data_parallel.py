"""`vecpool serve --data-parallel-size 2` on the CPU: two engine processes behind one port.

Calls spread over both engines (counted in prompt tokens) and answer what one engine answers;
one engine process killed fails its own calls at once and turns /health to 503 naming it,
while the other finishes its calls and takes every new one; the killed one is restarted (alone)
and takes calls again.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import transformers

import vecpool
from tests.helpers import save_hf_model
from tests.server.conftest import Server, ServerPool, ServerSpec, assert_error
from tests.server.gate import EngineGate
from tests.server.test_processes import _alive
from tests.tasks.conftest import tiny_bert_head, with_minilm_tokenizer
from vecpool.cli.serve import add_serve_arguments, serve

# An input batched with others runs through matrix products of other shapes; their float32
# sums round differently (well below this on the tiny model).
BATCHING_TOLERANCE = 1e-6
WORDS = "cats dogs eat fish bread a man woman runs quickly over under river city".split()


def _tiny_model(folder: Path, default_model_dir: Path) -> list[str]:
    """A random 2-layer BERT (hidden 32, 128 positions) on the MiniLM tokenizer, then two
    engine processes, one input per step, info logs (the engines' pids)."""
    model = save_hf_model(tiny_bert_head(transformers.BertModel), folder / "model")
    with_minilm_tokenizer(model, default_model_dir)
    return [str(model), "--data-parallel-size", "2", "--max-num-seqs", "1"]


# Behind a gate the tests may hold (open unless a test closes it). The last test of this
# module kills one of its engines.
SERVERS = {
    "dp_server": ServerSpec(
        _tiny_model, fixtures=("default_model_dir",), log_level="info", gated=True
    )
}


@pytest.fixture(scope="module")
def tiny_dir(server_pool: ServerPool, request: pytest.FixtureRequest) -> Path:
    return server_pool.folder(request, "dp_server") / "model"


@pytest.fixture(scope="module")
def tiny_engine(tiny_dir: Path) -> vecpool.Engine:
    return vecpool.Engine(tiny_dir, device="cpu")


def _engine_pids(server: Server) -> list[int]:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        found = re.search(r"engine processes \(pids ([\d, ]+)\)", server.log.read_text())
        if found:
            return [int(p) for p in found[1].split(", ")]
        time.sleep(0.1)
    raise AssertionError(f"no engine pids in the log:\n{server.log.read_text()}")


def _answered_tokens(server: Server) -> list[float]:
    return [server.metric("vecpool_engine_answered_tokens_total", engine=str(i)) for i in (0, 1)]


@pytest.fixture(scope="module")
def dp_gate(server_pool: ServerPool, request: pytest.FixtureRequest) -> EngineGate:
    return server_pool.gate(request, "dp_server")


@pytest.fixture(scope="module")
def dp_server(server_pool: ServerPool, request: pytest.FixtureRequest) -> Iterator[Server]:
    srv = server_pool.take(request, "dp_server")
    yield srv
    srv.stop()


def test_calls_spread_over_both_engines_by_tokens(
    dp_server: Server, dp_gate: EngineGate, tiny_engine: vecpool.Engine
) -> None:
    """32 calls sent while both engines are held (the gate): none is answered before the last
    is placed, so each goes to the engine with fewer queued tokens, in whatever order they
    come, and the two loads end at most one call's tokens apart. Opened, every call answers
    what one engine answers."""
    assert len(_engine_pids(dp_server)) == 2
    rng = np.random.default_rng(5)
    bodies = [
        [" ".join(rng.choice(WORDS, size=int(rng.integers(2, 40)))) for _ in range(k)]
        for k in rng.integers(1, 6, size=32)
    ]
    sizes = [sum(len(tiny_engine.tokenize(text)) for text in body) for body in bodies]
    tokens = sum(sizes)
    before = _answered_tokens(dp_server)

    def queued() -> list[float]:
        return [dp_server.metric("vecpool_engine_queued_tokens", engine=e) for e in ("0", "1")]

    async def main() -> tuple[list[float], list[httpx.Response]]:
        async with httpx.AsyncClient(base_url=dp_server.url, timeout=60) as http:
            with dp_gate.held():
                calls = [
                    asyncio.ensure_future(http.post("/v1/embeddings", json={"input": body}))
                    for body in bodies
                ]
                # Until every call is placed (60 s only bound a failure).
                await asyncio.to_thread(
                    dp_server.wait_for,
                    "vecpool_engine_queued_tokens",
                    lambda _: sum(queued()) == tokens,
                    60,
                    engine="0",
                )
                placed = queued()
            return placed, list(await asyncio.gather(*calls))

    placed, responses = asyncio.run(asyncio.wait_for(main(), 120))
    assert min(placed) > 0 and abs(placed[0] - placed[1]) <= max(sizes), (placed, max(sizes))
    expected = iter(tiny_engine.embed([text for body in bodies for text in body]))
    for body, size, response in zip(bodies, sizes, responses, strict=True):
        assert response.status_code == 200, response.text
        got = np.array([d["embedding"] for d in response.json()["data"]], dtype=np.float32)
        one_engine = np.stack([next(expected) for _ in body])
        assert np.abs(got - one_engine).max() <= BATCHING_TOLERANCE
        assert response.json()["usage"]["prompt_tokens"] == size
    served = [a - b for a, b in zip(_answered_tokens(dp_server), before, strict=True)]
    assert served == placed  # each engine answered what it was given
    assert queued() == [0.0, 0.0]
    assert dp_server.client.get("/health").status_code == 200


def test_killed_engine_fails_its_calls_and_the_other_serves(
    dp_server: Server, dp_gate: EngineGate, tiny_engine: vecpool.Engine
) -> None:
    """Both engines held before their first step (the gate): a call on each stays queued; the
    one whose engine is killed fails while the gate is still closed (at once, by
    construction: nothing else could have answered it), the other completes once opened."""
    server = dp_server
    pids = _engine_pids(server)
    long = [101] + [7592] * 126 + [102]
    results: list[httpx.Response] = []

    def slow_call() -> None:
        results.append(server.post("/v1/embeddings", {"input": [long] * 256}))

    threads = [threading.Thread(target=slow_call) for _ in range(2)]
    os.kill(server.process.pid, signal.SIGSTOP)  # hold the supervisor: no restart yet
    try:
        with dp_gate.held():
            for thread in threads:
                thread.start()
            for engine in ("0", "1"):  # one call on each engine (the other holds more tokens)
                server.wait_for(
                    "vecpool_engine_queued_tokens", lambda v: v == 256 * 128, 60, engine=engine
                )
            assert _alive(pids[1])
            os.kill(pids[1], signal.SIGKILL)
            _the_killed_engines_call_fails(server, results)
        _the_survivor_serves(server, tiny_engine, pids, results, threads, long)
    finally:
        os.kill(server.process.pid, signal.SIGCONT)

    # Engine 1 is restarted, alone: /health 200 again, and calls reach it again.
    server.wait_healthy()
    assert server.metric("vecpool_engine_restarts_total", engine="1") == 1
    assert server.metric("vecpool_engine_restarts_total", engine="0") == 0
    before = _answered_tokens(server)
    for _ in range(4):  # round robin among equals: one of each two idle calls reaches engine 1
        response = server.post("/v1/embeddings", {"input": "after the restart"})
        assert response.status_code == 200, response.text
    after = _answered_tokens(server)
    assert after[1] > before[1] and after[0] > before[0]
    assert _alive(pids[0])  # the survivor served throughout, never restarted


def _the_killed_engines_call_fails(server: Server, results: list[httpx.Response]) -> None:
    """While the gate holds both engines: /health turns 503 naming the killed one, whose call
    fails with 503 (the survivor's cannot have finished: its engine has not stepped)."""
    deadline = time.monotonic() + 30
    while (health := server.client.get("/health")).status_code == 200:
        assert time.monotonic() < deadline, "/health still 200 after the kill"
        time.sleep(0.02)
    assert_error(health, 503)
    assert "engine process 1 (cpu) exited" in health.json()["error"]["message"]
    while not results:
        assert time.monotonic() < deadline, "the killed engine's call is still waiting"
        time.sleep(0.01)
    (failed,) = results
    assert_error(failed, 503)
    assert "engine process 1" in failed.json()["error"]["message"]


def _the_survivor_serves(
    server: Server,
    tiny_engine: vecpool.Engine,
    pids: list[int],
    results: list[httpx.Response],
    threads: list[threading.Thread],
    long: list[int],
) -> None:
    """The gate open: the survivor's call completes, and new calls go to the survivor while
    /health stays 503 (one engine is gone)."""
    for thread in threads:
        thread.join(timeout=120)
        assert not thread.is_alive()
    done = results[1]
    assert done.status_code == 200, done.text
    vectors = np.array([d["embedding"] for d in done.json()["data"]], dtype=np.float32)
    assert vectors.shape[0] == 256
    assert np.abs(vectors - tiny_engine.embed([long])[0]).max() <= BATCHING_TOLERANCE
    before = _answered_tokens(server)
    for text in ("a new call", "and another", "and a third"):
        response = server.post("/v1/embeddings", {"input": text})
        assert response.status_code == 200, response.text
    after = _answered_tokens(server)
    assert after[1] == before[1] and after[0] > before[0]
    assert server.client.get("/health").status_code == 503
    assert _alive(pids[0])


def test_data_parallel_needs_engine_processes(capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    args = parser.parse_args(
        ["--device", "cpu", "--data-parallel-size", "2", "--api-server-count", "0"]
    )
    assert serve(args) == 2
    assert "--api-server-count 1 or more" in capsys.readouterr().err
