"""What one bad input, a broken model, a flood and long use do to an app in this process:
the others get exact answers; a broken engine errs every request and turns /health to 503;
the queue admits by expected wait and refuses the rest at once; memory stays flat."""

from __future__ import annotations

import asyncio
import gc
import os
import resource
import threading
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import vecpool
from tests.server.asgi import error_shape, serving, tiny_model_folder
from tests.server.test_hostile import HUGE, npy_b64
from vecpool.api import async_engine
from vecpool.server.routes import common


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path) -> Path:
    return tiny_model_folder(tmp_path_factory.mktemp("tiny"), default_model_dir)


@pytest.fixture
def engine(folder: Path) -> vecpool.Engine:
    return vecpool.Engine(folder, device="cpu", max_model_len=128)


class Gate:
    """Holds the engine's forward until opened."""

    def __init__(self, engine: vecpool.Engine, monkeypatch: pytest.MonkeyPatch):
        self.open = threading.Event()
        self.entered = threading.Event()
        runner = engine.core.model_runner
        forward = runner.forward

        def held(batch: Any) -> Any:
            self.entered.set()
            assert self.open.wait(30)
            return forward(batch)

        monkeypatch.setattr(runner, "forward", held)


async def _until(predicate: Callable[[], bool], timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline
        await asyncio.sleep(0.002)


TEXTS = [f"text number {i} about something else" for i in range(8)]


def test_a_poison_input_fails_alone(
    engine: vecpool.Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Eight texts and one prompt-embeds input whose output overflows, in one step: the eight
    get the vectors they get alone, the poison one a 400."""
    expected = engine.embed(TEXTS)
    gate = Gate(engine, monkeypatch)

    async def scenario() -> None:
        async with serving(engine) as (client, state):
            first = asyncio.ensure_future(client.post("/v1/embeddings", json={"input": "hold"}))
            await asyncio.to_thread(gate.entered.wait, 10)  # the engine is held in a step
            poison = {"input": [{"prompt_embeds": npy_b64(HUGE)}]}
            tasks = [client.post("/v1/embeddings", json={"input": t}) for t in TEXTS[:4]]
            tasks.append(client.post("/v1/embeddings", json=poison))
            tasks += [client.post("/v1/embeddings", json={"input": t}) for t in TEXTS[4:]]
            pending = [asyncio.ensure_future(t) for t in tasks]
            await _until(lambda: state.client is not None and state.client.num_queued == 10)
            gate.open.set()  # the nine run in one step
            responses = await asyncio.gather(*pending)
            assert (await first).status_code == 200
            bad = responses.pop(4)
            assert bad.status_code == 400 and "not finite" in bad.text, bad.text
            got = np.array([r.json()["data"][0]["embedding"] for r in responses], np.float32)
            assert np.abs(got - expected).max() < 1e-6
            assert (await client.get("/health")).status_code == 200

    asyncio.run(scenario())


def test_a_broken_forward_errs_everyone_and_health_turns_503(
    engine: vecpool.Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(batch: Any) -> Any:
        raise RuntimeError("device lost")

    monkeypatch.setattr(engine.core.model_runner, "forward", broken)

    async def scenario() -> None:
        async with serving(engine) as (client, _):
            assert (await client.get("/health")).status_code == 200
            bodies = [{"input": t} for t in TEXTS[:6]]
            responses = await asyncio.gather(
                *(client.post("/v1/embeddings", json=b) for b in bodies)
            )
            for r in responses:
                assert r.status_code >= 500 and "device lost" in r.text, r.text
                error_shape(r)
                assert r.headers["connection"] == "close"
            # The engine marks itself at fault before it fails the step's requests: the first
            # health check after their answers already sees it.
            assert (await client.get("/health")).status_code == 503

    asyncio.run(scenario())


def test_overload_refuses_exactly_the_excess_at_once(
    engine: vecpool.Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the engine held and its speed set so that Q requests are 10 s of work, Q + K
    requests: exactly K refused (429), each while the engine is held (so before any work was
    done: none of them was queued); once past the bound, a request is refused before its body
    is read (an unparsable body gets 429, not 400). How fast a refusal is, is measured (and
    printed), not asserted: a loaded machine stretches any latency."""
    q, k, tokens, max_wait = 16, 24, 10, 10.0
    gate = Gate(engine, monkeypatch)
    body = {"input": [[101, *range(2000, 2000 + tokens - 2), 102]]}

    async def scenario() -> list[float]:
        async with serving(engine, max_queue_wait=max_wait) as (client, state):
            front: Any = state.client
            front.admission.tokens_per_second = (q + 0.5) * tokens / max_wait
            admitted = [asyncio.ensure_future(client.post("/v1/embeddings", json=body))]
            await asyncio.to_thread(gate.entered.wait, 10)
            admitted += [
                asyncio.ensure_future(client.post("/v1/embeddings", json=body))
                for _ in range(q - 1)
            ]
            await _until(lambda: front.num_queued == q)
            latencies = []
            for _ in range(k):
                start = time.perf_counter()
                # A queued request would wait for the gate: only a refusal can come back.
                response = await asyncio.wait_for(client.post("/v1/embeddings", json=body), 30)
                latencies.append(time.perf_counter() - start)
                assert response.status_code == 429, response.text
                assert response.json()["error"]["code"] == "queue_full"
                assert response.headers["retry-after"] == "1"
            assert front.num_queued == q  # none of the K was queued
            front.admission.tokens_per_second /= 2  # now 20 s of work are queued
            start = time.perf_counter()
            garbage = await client.post("/v1/embeddings", content=b"{not json")
            latencies.append(time.perf_counter() - start)
            assert garbage.status_code == 429 and "s of work" in garbage.text
            assert garbage.headers["connection"] == "close"
            assert (await client.get("/health")).status_code == 200  # not held by the queue
            gate.open.set()
            assert all(r.status_code == 200 for r in await asyncio.gather(*admitted))
            return latencies

    latencies = asyncio.run(scenario())
    p99 = float(np.percentile(latencies, 99))
    print(f"429 latency p50 {np.median(latencies) * 1000:.2f} ms, p99 {p99 * 1000:.2f} ms")


class StepClock:
    """The in-process engine's clock (`time.perf_counter` as `async_engine` reads it), moved
    by its steps alone: each forward takes exactly `seconds` of it. Queue times and the speed
    the engine measures are then those of a machine with nothing else to do, in every run."""

    def __init__(self, engine: vecpool.Engine, monkeypatch: pytest.MonkeyPatch, seconds: float):
        self.now = 0.0
        runner = engine.core.model_runner
        forward = runner.forward

        def timed(batch: Any) -> Any:
            self.now += seconds  # the step's time passes as it starts (a Gate may hold it)
            return forward(batch)

        monkeypatch.setattr(runner, "forward", timed)
        clock = type("time", (), {"__getattr__": lambda _, name: getattr(time, name)})()
        clock.perf_counter = lambda: self.now
        monkeypatch.setattr(async_engine, "time", clock)


def test_admitted_requests_wait_within_the_bound(
    folder: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A slow engine (steps of at most 4 inputs, 1/16 s each on its clock), its speed measured
    by itself, and a flood of 120 requests while it is held in a step: exactly those whose
    wait fits the bound (0.5 s) are admitted, and wait at most that; the rest are refused at
    once; /health answers meanwhile. Without admission the last would wait 1.8 s."""
    engine = vecpool.Engine(folder, device="cpu", max_model_len=128, max_num_seqs=4)
    gate = Gate(engine, monkeypatch)
    gate.open.set()
    step, max_wait, tokens = 1 / 16, 0.5, 32
    StepClock(engine, monkeypatch, step)
    ids = [101, *range(3000, 3000 + tokens - 2), 102]
    body = {"input": [ids]}

    async def scenario() -> tuple[list[float], int]:
        async with serving(engine, max_queue_wait=max_wait) as (client, state):
            front: Any = state.client
            # Warm up: eight full steps (one call of 4 inputs each), 1/2 s of stepping, two
            # samples of the engine's speed (the first dropped, as holding one-off costs):
            # 4 * 4 * 32 tokens / 0.25 s = 2,048 tokens/s.
            for _ in range(8):
                warm = await client.post("/v1/embeddings", json={"input": [ids] * 4})
                assert warm.status_code == 200, warm.text
            # The engine thread counts a step once it has returned, after its answers.
            await _until(lambda: front.admission.tokens_per_second is not None, 30)
            assert front.admission.tokens_per_second == 4 * 4 * tokens / (4 * step)
            assert front.expected_wait == 0
            gate.open.clear()
            gate.entered.clear()
            flood = [asyncio.ensure_future(client.post("/v1/embeddings", json=body))]
            await asyncio.to_thread(gate.entered.wait, 30)  # the first holds the engine
            flood += [
                asyncio.ensure_future(client.post("/v1/embeddings", json=body)) for _ in range(119)
            ]
            # Until each of the 120 is refused or queued (probing /health meanwhile).
            while sum(f.done() for f in flood) + front.num_queued < len(flood):
                start = time.perf_counter()
                assert (await client.get("/health")).status_code == 200
                probes.append(time.perf_counter() - start)
                await asyncio.sleep(0.005)
            gate.open.set()
            responses = await asyncio.gather(*flood)
            waits = [
                float(r.headers["x-queue-time"]) / 1000 for r in responses if r.status_code == 200
            ]
            refused = sum(r.status_code == 429 for r in responses)
            assert all(r.status_code in (200, 429) for r in responses)
            return waits, refused

    probes: list[float] = []
    waits, refused = asyncio.run(scenario())
    print(f"admitted {len(waits)}, refused {refused}, longest wait {max(waits):.4f} s")
    print(f"/health during the flood: {len(probes)} probes, longest {max(probes) * 1000:.1f} ms")
    # Admitted while the queued tokens, this call's with them, take at most 0.5 s at 2,048
    # tokens/s: 32 inputs (the one held in its step among them).
    assert len(waits) == 32
    assert refused == 120 - 32
    # The 31 behind the held one run in 8 steps after it: the last starts 7 steps after the
    # held step ends (7/16 s).
    assert max(waits) == pytest.approx(7 * step, abs=1e-6)
    assert max(waits) <= max_wait


def test_the_measured_speed_is_the_engines_own_over_calls_of_several_steps(
    folder: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Calls of 12 inputs, each run in 3 steps of 4 (1/16 s each on the engine's clock): every
    sample of the speed is the engine's, 4 * 32 tokens per 1/16 s. Counted as inputs finished,
    a call's first step finished nothing (pooled in the next) and its last finished two: a
    sample of 4 steps that ended on a call's last step held 5 steps' tokens (2,560 tokens/s
    where the engine ran 2,048), and the best sample is the speed."""
    engine = vecpool.Engine(folder, device="cpu", max_model_len=128, max_num_seqs=4)
    step, tokens = 1 / 16, 32
    StepClock(engine, monkeypatch, step)
    ids = [101, *range(3000, 3000 + tokens - 2), 102]

    async def scenario() -> list[float]:
        async with serving(engine, max_queue_wait=10.0) as (client, state):
            front: Any = state.client
            for _ in range(8):  # 24 steps: 6 samples of 4 steps (the first dropped)
                response = await client.post("/v1/embeddings", json={"input": [ids] * 12})
                assert response.status_code == 200, response.text
            await _until(lambda: len(front.admission._samples) >= 5, 5)
            return list(front.admission._samples)

    assert asyncio.run(scenario()) == [4 * tokens / step] * 5


def test_a_request_past_its_deadline_is_dropped(
    engine: vecpool.Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    gate = Gate(engine, monkeypatch)

    async def scenario() -> None:
        async with serving(engine) as (client, state):
            held = asyncio.ensure_future(client.post("/v1/embeddings", json={"input": "a"}))
            await asyncio.to_thread(gate.entered.wait, 10)
            # The engine is held: only a deadline can answer. Of two queued behind it, the one
            # of 0.2 s is dropped while the one of 600 s still waits (which, and the 30 s
            # here, only bound a failure).
            patient = asyncio.ensure_future(
                client.post(
                    "/v1/embeddings", json={"input": "c"}, headers={"x-request-timeout": "600"}
                )
            )
            response = await asyncio.wait_for(
                client.post(
                    "/v1/embeddings", json={"input": "b"}, headers={"x-request-timeout": "0.2"}
                ),
                30,
            )
            assert response.status_code == 408, response.text
            assert response.json()["error"]["code"] == "deadline_exceeded"
            assert "x-request-timeout of 0.2 s" in response.json()["error"]["message"]
            assert not patient.done()
            await _until(lambda: state.client is not None and state.client.num_queued == 2)
            bad = await client.post(
                "/v1/embeddings", json={"input": "b"}, headers={"x-request-timeout": "soon"}
            )
            assert bad.status_code == 400 and bad.json()["error"]["param"] == "x-request-timeout"
            gate.open.set()
            assert (await held).status_code == 200
            assert (await patient).status_code == 200

    asyncio.run(scenario())


# ---- memory ----------------------------------------------------------------------------


def rss_bytes() -> int:
    try:
        with open(f"/proc/{os.getpid()}/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:  # not Linux: the peak, which a leak raises too
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


ROUNDS, PER_ROUND, SETTLE = 8, 150, 3
# Growth from round SETTLE to the last: of the process (which the allocator's free memory,
# left by earlier tests, can hide), and of what Python allocated and still holds (traced).
RSS_PLATEAU = 24 * 2**20
TRACED_PLATEAU = 4 * 2**20


def memory_growth(engine: vecpool.Engine) -> tuple[int, int]:
    """(RSS, traced) bytes the process grew from round SETTLE to the last of ROUNDS rounds."""
    bodies = [
        {"input": ["one text", "two texts here"]},
        {"input": [[101, 2000, 2001, 102]], "encoding_format": "base64"},
    ]
    rss: list[int] = []
    traced: list[int] = []

    async def scenario() -> None:
        async with serving(engine) as (client, _):
            for _ in range(ROUNDS):
                for i in range(0, PER_ROUND, 10):
                    batch = [bodies[(i + j) % 2] for j in range(10)]
                    responses = await asyncio.gather(
                        *(client.post("/v1/embeddings", json=b) for b in batch)
                    )
                    assert all(r.status_code == 200 for r in responses)
                gc.collect()
                rss.append(rss_bytes())
                traced.append(tracemalloc.get_traced_memory()[0])

    tracemalloc.start()
    try:
        asyncio.run(scenario())
    finally:
        tracemalloc.stop()
    print("rss per round (MB):", [round(x / 2**20, 1) for x in rss])
    print("traced per round (MB):", [round(x / 2**20, 1) for x in traced])
    return max(rss[SETTLE:]) - rss[SETTLE - 1], max(traced[SETTLE:]) - traced[SETTLE - 1]


def plateaus(growth: tuple[int, int]) -> bool:
    return growth[0] < RSS_PLATEAU and growth[1] < TRACED_PLATEAU


def test_memory_plateaus_and_a_leak_is_caught(
    engine: vecpool.Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    growth = memory_growth(engine)
    assert plateaus(growth), f"grew {growth[0] / 2**20:.1f} MB, traced {growth[1] / 2**20:.1f} MB"

    leaked: list[bytes] = []
    headers = common.Timings.headers

    def leaking(self: common.Timings) -> dict[str, str]:
        leaked.append(os.urandom(64 * 1024))  # 64 kB kept per request
        return headers(self)

    monkeypatch.setattr(common.Timings, "headers", leaking)
    leaky = memory_growth(engine)
    assert not plateaus(leaky), f"the leaking build grew only {leaky[1] / 2**20:.1f} MB traced"
