"""Good requests against a real server: OpenAI client, mixed inputs, pooling, tokenize."""

from __future__ import annotations

import base64
import io
import threading
import time

import numpy as np
import openai
import pytest
import torch

import vecpool
from tests.server.conftest import MODEL_NAME, Server

TEXTS = ["A man is playing a guitar.", "The cat sleeps on the windowsill.", "Paris in spring"]


def npy_b64(array: np.ndarray) -> str:
    buf = io.BytesIO()
    np.save(buf, array, allow_pickle=False)
    return base64.b64encode(buf.getvalue()).decode()


def torch_b64(tensor: torch.Tensor) -> str:
    buf = io.BytesIO()
    torch.save(tensor, buf)
    return base64.b64encode(buf.getvalue()).decode()


def vectors(body: dict, key: str = "embedding") -> np.ndarray:
    assert [d["index"] for d in body["data"]] == list(range(len(body["data"])))
    return np.asarray([d[key] for d in body["data"]], dtype=np.float32)


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


@pytest.mark.parametrize("encoding_format", ["float", "base64"])
def test_openai_client_matches_engine(
    client: openai.OpenAI, minilm: vecpool.Engine, encoding_format: str
) -> None:
    expected = minilm.embed(TEXTS)
    response = client.embeddings.create(
        model=MODEL_NAME,
        input=TEXTS,
        encoding_format=encoding_format,  # type: ignore[arg-type]
    )
    if encoding_format == "base64":  # asked for explicitly, the client leaves it encoded
        rows = [np.frombuffer(base64.b64decode(str(d.embedding)), "<f4") for d in response.data]
    else:
        rows = [np.asarray(d.embedding, dtype=np.float32) for d in response.data]
    got = np.stack(rows)
    assert [d.index for d in response.data] == [0, 1, 2]
    assert got.shape == expected.shape == (3, 384)
    assert np.abs(got - expected).max() <= 1e-6
    tokens = sum(len(minilm.tokenize(t)) for t in TEXTS)
    assert response.usage.prompt_tokens == response.usage.total_tokens == tokens
    assert response.model == MODEL_NAME


def test_openai_client_default_encoding_and_dimensions(
    client: openai.OpenAI, minilm: vecpool.Engine
) -> None:
    # No encoding_format: the client asks for base64 and decodes it itself.
    response = client.embeddings.create(model=MODEL_NAME, input=TEXTS[0])
    got = np.asarray(response.data[0].embedding, dtype=np.float32)
    assert np.abs(got - minilm.embed([TEXTS[0]])[0]).max() <= 1e-6
    assert got.shape == (384,) and abs(float(np.linalg.norm(got)) - 1) < 1e-5
    # MiniLM declares no matryoshka support: `dimensions` is refused, as OpenAI and vLLM do.
    with pytest.raises(openai.BadRequestError, match="does not support matryoshka"):
        client.embeddings.create(model=MODEL_NAME, input=TEXTS[0], dimensions=64)


def test_mixed_inputs_in_order_embeds_equal_tokens(server: Server, minilm: vecpool.Engine) -> None:
    ids_a = minilm.tokenize(TEXTS[0])
    ids_b = minilm.tokenize(TEXTS[1])
    embeds_a = minilm.embed_tokens(ids_a)
    embeds_b = minilm.embed_tokens(ids_b)
    inputs = [
        TEXTS[2],
        ids_a,
        {"prompt_embeds": npy_b64(embeds_a.numpy())},
        {"prompt_embeds": torch_b64(embeds_b)},
        ids_b,
        TEXTS[0],
    ]
    response = server.post("/v1/embeddings", {"model": MODEL_NAME, "input": inputs})
    assert response.status_code == 200, response.text
    got = vectors(response.json())
    # Embeds ≡ tokens, bit for bit: prompt embeds that are the model's own lookup of the ids
    # fill the same rows as the ids would, so the same batch given as ids is the same
    # computation. (Two copies at different rows of one batch are not: a matmul's kernel may
    # round rows differently by where they fall in its blocks.)
    as_ids = [TEXTS[2], ids_a, ids_a, ids_b, ids_b, TEXTS[0]]
    same_as_ids = server.post("/v1/embeddings", {"model": MODEL_NAME, "input": as_ids})
    assert np.array_equal(got, vectors(same_as_ids.json()))
    # The engine in this process: another process, maybe another thread count (see conftest).
    expected = minilm.embed(as_ids)
    assert np.abs(got - expected).max() <= 1e-6
    assert np.abs(got[5] - got[1]).max() <= 1e-6  # the text and its own token ids
    usage = response.json()["usage"]["prompt_tokens"]
    assert usage == len(minilm.tokenize(TEXTS[2])) + 3 * len(ids_a) + 2 * len(ids_b)
    assert int(response.headers["x-prompt-tokens"]) == usage
    assert int(response.headers["x-num-inputs"]) == 6


def test_single_token_array_and_half_precision_embeds(
    server: Server, minilm: vecpool.Engine
) -> None:
    ids = minilm.tokenize(TEXTS[1])
    half = minilm.embed_tokens(ids).half()
    as_torch, as_npy = {"prompt_embeds": torch_b64(half)}, {"prompt_embeds": npy_b64(half.numpy())}
    response = server.post("/v1/embeddings", {"input": [as_torch, as_npy]})
    assert response.status_code == 200, response.text
    got = vectors(response.json())
    # Both formats decode to the same rows: swapped, the batch is the same computation, bit
    # for bit (the two rows of one batch need not be: see above).
    swapped = server.post("/v1/embeddings", {"input": [as_npy, as_torch]})
    assert np.array_equal(vectors(swapped.json()), got)
    assert np.abs(got[0] - got[1]).max() <= 1e-6
    one = server.post("/v1/embeddings", {"input": ids})  # a flat id list is one input
    assert len(one.json()["data"]) == 1
    assert np.abs(vectors(one.json())[0] - minilm.embed([ids])[0]).max() <= 1e-6


@pytest.mark.parametrize(
    ("embed_dtype", "numpy_dtype", "tolerance"),
    [("float32", "<f4", 0.0), ("float16", "<f2", 1e-3), ("bfloat16", None, 8e-3)],
)
def test_base64_embed_dtypes(
    server: Server,
    minilm: vecpool.Engine,
    embed_dtype: str,
    numpy_dtype: str | None,
    tolerance: float,
) -> None:
    body = {"input": TEXTS, "encoding_format": "base64", "embed_dtype": embed_dtype}
    response = server.post("/v1/embeddings", body)
    assert response.status_code == 200, response.text
    rows = []
    for item in response.json()["data"]:
        raw = base64.b64decode(item["embedding"])
        if numpy_dtype is None:  # bfloat16: the upper half of a float32
            halves = np.frombuffer(raw, dtype="<u2").astype(np.uint32) << 16
            rows.append(halves.view(np.float32))
        else:
            rows.append(np.frombuffer(raw, dtype=numpy_dtype).astype(np.float32))
    got = np.stack(rows)
    assert got.shape == (3, 384)
    assert np.abs(got - minilm.embed(TEXTS)).max() <= max(tolerance, 1e-6)
    floats = server.post("/v1/embeddings", {**body, "encoding_format": "float"})
    # The same request again is the same computation: floats are rounded the same way.
    assert np.array_equal(vectors(floats.json()), got)


def test_truncation(server: Server, minilm: vecpool.Engine) -> None:
    long_ids = [101] + [7592] * 298 + [102]
    refused = server.post("/v1/embeddings", {"input": [long_ids]})
    assert refused.status_code == 400 and "truncate_prompt_tokens" in refused.text
    response = server.post("/v1/embeddings", {"input": [long_ids], "truncate_prompt_tokens": -1})
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["prompt_tokens"] == 256
    expected = minilm.embed([long_ids[:256]])
    assert np.abs(vectors(response.json()) - expected).max() <= 1e-6


def test_pooling_token_embed(server: Server, minilm: vecpool.Engine) -> None:
    expected = minilm.encode(TEXTS[:2], task="token_embed")
    response = server.post("/pooling", {"input": TEXTS[:2], "task": "token_embed"})
    assert response.status_code == 200, response.text
    data = response.json()["data"]
    assert [d["object"] for d in data] == ["pooling", "pooling"]
    for item, exp in zip(data, expected, strict=True):
        got = np.asarray(item["data"], dtype=np.float32)
        assert got.shape == exp.shape and np.abs(got - exp).max() <= 1e-5
    packed = server.post(
        "/pooling", {"input": TEXTS[0], "task": "token_embed", "encoding_format": "base64"}
    )
    item = packed.json()["data"][0]
    got = np.frombuffer(base64.b64decode(item["data"]), dtype="<f4").reshape(item["shape"])
    assert np.abs(got - expected[0]).max() <= 1e-5
    embed = server.post("/pooling", {"input": TEXTS, "task": "embed"})
    assert np.abs(vectors(embed.json(), "data") - minilm.embed(TEXTS)).max() <= 1e-6


def test_tokenize_detokenize_round_trip(server: Server, minilm: vecpool.Engine) -> None:
    text = "the quick brown fox jumps over the lazy dog"
    response = server.post("/tokenize", {"prompt": text})
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["tokens"] == minilm.tokenize(text)
    assert body["count"] == len(body["tokens"]) and body["max_model_len"] == 256
    back = server.post("/detokenize", {"tokens": body["tokens"]})
    assert back.status_code == 200 and back.json() == {"prompt": text}


def test_models_health_metrics(server: Server) -> None:
    models = server.client.get("/v1/models").json()
    assert [m["id"] for m in models["data"]] == [MODEL_NAME]
    assert models["data"][0]["max_model_len"] == 256
    assert models["data"][0]["tasks"] == ["embed", "token_embed"]
    assert models["data"][0]["score_mode"] == "embed"  # /score and /rerank: cosine
    before = time.time()
    health = server.client.get("/health").json()
    assert health["status"] == "ok" and before <= health["unix"] <= time.time()  # read meanwhile
    before = server.metric("vecpool_http_requests_total", endpoint="/v1/embeddings", status="200")
    response = server.post("/v1/embeddings", {"input": TEXTS})
    for header in ("x-queue-time", "x-tokenization-time", "x-inference-time"):
        assert float(response.headers[header]) >= 0
    assert float(response.headers["x-inference-time"]) > 0
    m = server.metrics()
    key = ("vecpool_http_requests_total", (("endpoint", "/v1/embeddings"), ("status", "200")))
    assert m[key] == before + 1
    for stage in ("queue", "tokenization", "inference"):
        name = f"vecpool_request_{stage}_seconds_count"
        assert m[(name, (("endpoint", "/v1/embeddings"),))] >= 1
    assert m[("vecpool_batch_tokens_sum", ())] > 0 and m[("vecpool_engine_steps_total", ())] > 0
    assert m[("vecpool_queue_size", ())] == 0


def test_concurrent_requests_in_the_same_moment(server: Server, minilm: vecpool.Engine) -> None:
    groups = [[f"request {i} sentence {j}" for j in range(1 + i % 3)] for i in range(8)]
    barrier = threading.Barrier(len(groups))
    results: list[np.ndarray | None] = [None] * len(groups)

    def call(i: int) -> None:
        barrier.wait()
        response = server.post("/v1/embeddings", {"input": groups[i]})
        assert response.status_code == 200, response.text
        results[i] = vectors(response.json())

    threads = [threading.Thread(target=call, args=(i,)) for i in range(len(groups))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(got is not None for got in results), "a request failed"
    got = np.concatenate([r for r in results if r is not None])
    assert np.abs(got - minilm.embed([t for g in groups for t in g])).max() <= 1e-6
    assert server.alive()
