"""Limits against a real server: API key, payload size, inputs per request, a full queue
(429), truncation, prompt embeds switched off, and a client that disconnects. The queue tests
hold the engine inside a step (`tests/server/gate.py`): what they look at cannot drain away."""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Iterator

import httpx
import numpy as np
import openai
import pytest

from tests.server.conftest import MODEL_NAME, Server, ServerPool, ServerSpec, assert_error
from tests.server.gate import EngineGate
from tests.server.test_embeddings import npy_b64

KEY = "sekret-key"
MAX_QUEUED = 8
# One input per engine step, each of the full 128 tokens: a queue that drains slowly.
LONG = [101] + [7592] * 126 + [102]


SERVERS = {
    "limited": ServerSpec(
        lambda folder: [
            *("--max-queued", str(MAX_QUEUED), "--max-num-seqs", "1", "--max-model-len", "128"),
            *("--auto-truncate", "--max-payload-mb", "0.05"),
        ],
        api_key=KEY,
        gated=True,
    )
}


@pytest.fixture(scope="module")
def gate(server_pool: ServerPool, request: pytest.FixtureRequest) -> EngineGate:
    return server_pool.gate(request, "limited")


@pytest.fixture(scope="module")
def limited(server_pool: ServerPool, request: pytest.FixtureRequest) -> Iterator[Server]:
    srv = server_pool.take(request, "limited")
    yield srv
    srv.stop()


def test_api_key(limited: Server) -> None:
    url = f"{limited.url}/v1/embeddings"
    body = {"input": "hello"}
    assert_error(httpx.post(url, json=body), 401)
    for value in ("Bearer wrong", f"Basic {KEY}", KEY, "Bearer"):
        response = httpx.post(url, json=body, headers={"authorization": value})
        assert response.json()["error"]["code"] == "invalid_api_key"
        assert_error(response, 401)
    assert httpx.post(url, json=body, headers={"authorization": f"Bearer {KEY}"}).status_code == 200
    assert httpx.get(f"{limited.url}/health").status_code == 200  # probes need no key
    assert httpx.get(f"{limited.url}/metrics").status_code == 200
    assert httpx.get(f"{limited.url}/ping").status_code == 200  # SageMaker's probe too
    for path in ("/info", "/embed", "/v2/embed", "/invocations"):
        assert httpx.post(f"{limited.url}{path}", json={}).status_code in (401, 405)
    assert_error(httpx.get(f"{limited.url}/v1/models"), 401)
    client = openai.OpenAI(base_url=f"{limited.url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        client.embeddings.create(model=MODEL_NAME, input="hello")
    client = openai.OpenAI(base_url=f"{limited.url}/v1", api_key=KEY, max_retries=0)
    assert len(client.embeddings.create(model=MODEL_NAME, input="hello").data[0].embedding) == 384


def test_payload_limit(limited: Server) -> None:
    big = {"input": ["word " * 12_000]}  # 60 kB, over the 0.05 MB limit
    message = assert_error(limited.post("/v1/embeddings", big), 413)
    assert "limit of 52428 bytes" in message

    def chunks() -> Iterator[bytes]:  # no content-length: counted while read
        yield b'{"input": ["'
        for _ in range(100):
            yield b"word " * 200
        yield b'"]}'

    response = limited.client.post(
        "/v1/embeddings", content=chunks(), headers={"content-type": "application/json"}
    )
    assert_error(response, 413)
    assert limited.post("/v1/embeddings", {"input": ["word " * 100]}).status_code == 200


def test_inputs_per_request_and_auto_truncate(limited: Server) -> None:
    message = assert_error(limited.post("/v1/embeddings", {"input": ["a"] * 9}), 400, "input")
    assert "limit of 8" in message
    response = limited.post("/v1/embeddings", {"input": [LONG + [7592] * 50]})
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["prompt_tokens"] == 128


def test_prompt_embeds_off_by_default(limited: Server) -> None:
    body = {"input": ["a", {"prompt_embeds": npy_b64(np.zeros((2, 384), np.float32))}]}
    message = assert_error(limited.post("/v1/embeddings", body), 400, "input[1].prompt_embeds")
    assert "--enable-prompt-embeds" in message


def test_full_queue_answers_429_at_once(limited: Server, gate: EngineGate) -> None:
    blocker: list[httpx.Response] = []
    thread = threading.Thread(
        target=lambda: blocker.append(limited.post("/v1/embeddings", {"input": [LONG] * 8}))
    )
    with gate.held():
        thread.start()
        gate.wait_entered()  # the blocker's inputs are queued in an engine that cannot step
        limited.wait_for("vecpool_queue_size", lambda v: v == MAX_QUEUED)
        response = limited.post("/v1/embeddings", {"input": [LONG] * 8})
        assert thread.is_alive()  # answered while the queue was full, not after it drained
    assert_error(response, 429)
    assert response.json()["error"]["code"] == "queue_full"
    assert response.headers["retry-after"] == "1"
    thread.join()
    assert blocker[0].status_code == 200
    assert float(blocker[0].headers["x-inference-time"]) > 0
    assert limited.post("/v1/embeddings", {"input": [LONG] * 8}).status_code == 200


def test_disconnected_client_is_dropped(limited: Server, gate: EngineGate) -> None:
    before = limited.metrics()
    body = json.dumps({"input": [LONG] * MAX_QUEUED}).encode()
    head = (
        "POST /v1/embeddings HTTP/1.1\r\nhost: test\r\ncontent-type: application/json\r\n"
        f"authorization: Bearer {KEY}\r\ncontent-length: {len(body)}\r\n\r\n"
    )
    gone = before.get(("vecpool_client_disconnects_total", (("endpoint", "/v1/embeddings"),)), 0)
    with gate.held():  # no step runs until the engine has taken the cancel
        with socket.create_connection(("127.0.0.1", int(limited.url.rsplit(":", 1)[1]))) as s:
            s.sendall(head.encode() + body)
            gate.wait_entered()
            limited.wait_for("vecpool_queue_size", lambda v: v == MAX_QUEUED)
        # The connection is closed: the server cancels the request's inputs still waiting.
        limited.wait_for(
            "vecpool_client_disconnects_total", lambda v: v == gone + 1, endpoint="/v1/embeddings"
        )
        limited.wait_for("vecpool_queue_size", lambda v: v == 0)
    after = limited.metrics()

    def delta(name: str, **labels: str) -> float:
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0.0) - before.get(key, 0.0)

    # Every input was still waiting when the cancel came: none ran.
    assert delta("vecpool_engine_requests_total", outcome="cancelled") == MAX_QUEUED
    assert delta("vecpool_engine_requests_total", outcome="finished") == 0
    assert delta("vecpool_engine_steps_total") == 0
    assert delta("vecpool_client_disconnects_total", endpoint="/v1/embeddings") == 1
    assert delta("vecpool_http_requests_total", endpoint="/v1/embeddings", status="499") == 1
    assert limited.alive()
    assert limited.post("/v1/embeddings", {"input": ["after"]}).status_code == 200


def test_peer_routes_keep_the_limits(limited: Server) -> None:
    # TEI: more inputs than a request may hold is its 413 "validation"; truncate null follows
    # --auto-truncate, truncate false refuses a long input.
    response = limited.post("/embed", {"inputs": ["a"] * 9})
    assert response.status_code == 413 and response.json()["error_type"] == "validation"
    assert "limit of 8" in response.json()["error"]
    long_text = "word " * 200
    assert limited.post("/embed", {"inputs": [long_text]}).status_code == 200
    refused = limited.post("/embed", {"inputs": [long_text], "truncate": False})
    assert refused.status_code == 413 and "maximum context length" in refused.json()["error"]
    # Cohere: the same limit, in Cohere's shape.
    response = limited.post("/v2/embed", {"texts": ["a"] * 9})
    assert response.status_code == 400 and "limit of 8" in response.json()["message"]
    # A body over --max-payload-mb.
    response = limited.post("/embed", {"inputs": ["a" * 60_000]})
    assert response.status_code == 413 and response.json()["error_type"] == "validation"
