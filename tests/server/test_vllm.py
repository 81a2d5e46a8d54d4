"""What vLLM's clients send, against live servers: the score names (`queries` / `documents`,
`data_1` / `data_2`, `queries` / `items`), `/tokenize` options, rerank `usage` and
`use_activation`, the `bytes` encodings, `endianness` and fp8 `embed_dtype`, SageMaker's
`/invocations`; and the errors that name the field that is wrong."""

from __future__ import annotations

import base64
import json

import numpy as np
import pytest
import torch

import vecpool
from tests.server.conftest import Server, assert_error
from vecpool.calls import postprocess

QUERY = "what do cats eat"
DOCS = ["the stock market fell sharply", "cats eat fish and mice", "pizza"]
TEXTS = ["A man is playing a guitar.", "The cat sleeps on the windowsill.", "Paris in spring"]
LONG = "word " * 300  # over every test model's limit


def scores(body: dict) -> list[float]:
    assert [d["index"] for d in body["data"]] == list(range(len(body["data"])))
    return [d["score"] for d in body["data"]]


@pytest.mark.parametrize(
    ("first", "second"),
    [("text_1", "text_2"), ("data_1", "data_2"), ("queries", "documents"), ("queries", "items")],
)
def test_score_names(
    cross_server: Server, cross_engine: vecpool.Engine, first: str, second: str
) -> None:
    response = cross_server.post("/score", {first: QUERY, second: DOCS})
    assert response.status_code == 200, response.text
    assert np.allclose(scores(response.json()), cross_engine.score(QUERY, DOCS), atol=1e-6)
    raw = cross_server.post("/score", {first: [QUERY] * 3, second: DOCS, "use_activation": False})
    expected = cross_engine.score([QUERY] * 3, DOCS, use_activation=False)
    assert np.allclose(scores(raw.json()), expected, atol=1e-6)
    # Errors name the request's own fields.
    assert_error(
        cross_server.post("/score", {first: [LONG, QUERY], second: DOCS[:2]}), 400, f"{first}[0]"
    )
    assert_error(cross_server.post("/score", {first: LONG, second: DOCS}), 400, first)
    assert_error(
        cross_server.post("/score", {first: QUERY, second: [DOCS[0], LONG]}), 400, f"{second}[1]"
    )
    assert_error(cross_server.post("/score", {first: QUERY, second: []}), 400, second)
    if first != "queries":  # queries alone fits two shapes
        assert_error(cross_server.post("/score", {first: QUERY}), 400, second)


def test_rerank_errors_name_the_field(server: Server, cross_server: Server) -> None:
    for srv in (server, cross_server):
        message = assert_error(
            srv.post("/rerank", {"query": LONG, "documents": DOCS}), 400, "query"
        )
        assert "maximum context length" in message
        assert_error(
            srv.post("/rerank", {"query": QUERY, "documents": [DOCS[0], LONG]}), 400, "documents[1]"
        )
        assert_error(
            srv.post("/score", {"text_1": [LONG, "a"], "text_2": DOCS[:2]}), 400, "text_1[0]"
        )


def test_a_classifier_with_several_labels_does_not_score(classifier_server: Server) -> None:
    for path, body in (
        ("/score", {"text_1": QUERY, "text_2": DOCS}),
        ("/rerank", {"query": QUERY, "documents": DOCS}),
        ("/v2/rerank", {"query": QUERY, "documents": DOCS}),
    ):
        response = classifier_server.post(path, body)
        message = assert_error(response, 404)  # vLLM serves these routes for scorers only
        assert response.json()["error"]["param"] is None
        assert "classifier with 2 labels (negative, positive), not a cross-encoder" in message
    # It classifies pairs, every label's probability.
    pairs = [{"text": QUERY, "text_pair": d} for d in DOCS]
    response = classifier_server.post("/classify", {"input": pairs})
    assert response.status_code == 200 and len(response.json()["data"][0]["probs"]) == 2


def test_rerank_usage_activation_and_top_n(
    cross_server: Server, cross_engine: vecpool.Engine
) -> None:
    body = {"query": QUERY, "documents": DOCS, "use_activation": False, "top_n": 0}
    response = cross_server.post("/rerank", body)
    assert response.status_code == 200, response.text
    result = response.json()
    expected = cross_engine.rerank(QUERY, DOCS, use_activation=False)
    assert [r["index"] for r in result["results"]] == [i for i, _ in expected]
    assert np.allclose(
        [r["relevance_score"] for r in result["results"]], [s for _, s in expected], atol=1e-6
    )
    tokens = int(response.headers["x-prompt-tokens"])
    assert result["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens} and tokens > 0
    # Infinity's raw_scores is the same switch.
    infinity = cross_server.post("/rerank", {"query": QUERY, "documents": DOCS, "raw_scores": True})
    assert [r["relevance_score"] for r in infinity.json()["results"]] == [
        r["relevance_score"] for r in result["results"]
    ]
    contradiction = {"query": QUERY, "documents": DOCS, "raw_scores": True, "use_activation": True}
    assert_error(cross_server.post("/v1/rerank", contradiction), 400, "raw_scores")
    # On /rerank, raw_scores marks Infinity's body, which has no use_activation (422 there).
    assert_error(cross_server.post("/rerank", contradiction), 422, "use_activation")
    top = cross_server.post("/rerank", {"query": QUERY, "documents": DOCS, "top_n": 1})
    assert [r["index"] for r in top.json()["results"]] == [expected[0][0]]
    assert_error(
        cross_server.post("/rerank", {"query": QUERY, "documents": DOCS, "top_n": -1}), 400, "top_n"
    )


def test_tokenize_options(server: Server, minilm: vecpool.Engine) -> None:
    text = "cats eat fish"
    plain = server.post("/tokenize", {"prompt": text, "add_special_tokens": False})
    assert plain.json()["tokens"] == minilm.tokenize(text)[1:-1]
    assert plain.json()["token_strs"] is None
    strs = server.post("/tokenize", {"prompt": text, "return_token_strs": True}).json()
    assert strs["token_strs"] == ["[CLS]", "cats", "eat", "fish", "[SEP]"]
    assert strs["count"] == 5 and strs["tokens"] == minilm.tokenize(text)


def decode(raw: bytes, dtype: str, endianness: str) -> np.ndarray:
    order = "<" if endianness == "little" else ">"
    if dtype == "bfloat16":
        halves = np.frombuffer(raw, f"{order}u2").astype(np.uint32) << 16
        return halves.view(np.float32)
    if dtype.startswith("fp8"):
        kind = torch.float8_e4m3fn if dtype == "fp8_e4m3" else torch.float8_e5m2
        return torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(kind).float().numpy()
    return np.frombuffer(raw, f"{order}{'f2' if dtype == 'float16' else 'f4'}").astype(np.float32)


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16", "fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("endianness", ["little", "big"])
def test_bytes_base64_and_floats_agree(server: Server, dtype: str, endianness: str) -> None:
    body = {"input": TEXTS, "embed_dtype": dtype, "endianness": endianness}
    floats = server.post("/v1/embeddings", {**body, "encoding_format": "float"}).json()
    rounded = np.asarray([d["embedding"] for d in floats["data"]], np.float32)
    packed = server.post("/v1/embeddings", {**body, "encoding_format": "base64"}).json()
    for item, row in zip(packed["data"], rounded, strict=True):
        assert np.array_equal(decode(base64.b64decode(item["embedding"]), dtype, endianness), row)
    response = server.post("/v1/embeddings", {**body, "encoding_format": "bytes"})
    assert response.headers["content-type"] == "application/octet-stream"
    metadata = json.loads(response.headers["metadata"])
    assert metadata["usage"] == floats["usage"]
    for item, row in zip(metadata["data"], rounded, strict=True):
        assert (item["embed_dtype"], item["endianness"], item["shape"]) == (
            dtype,
            endianness,
            [384],
        )
        got = decode(response.content[item["start"] : item["end"]], dtype, endianness)
        assert np.array_equal(got, row)
    only = server.post("/v1/embeddings", {**body, "encoding_format": "bytes_only"})
    assert "metadata" not in only.headers and only.content == response.content
    exact = server.post("/v1/embeddings", {"input": TEXTS}).json()
    full = np.asarray([d["embedding"] for d in exact["data"]], np.float32)
    tolerance = {"float32": 0, "float16": 1e-3, "bfloat16": 8e-3}.get(dtype, 0.07)
    assert np.abs(rounded - full).max() <= tolerance


def test_native_byte_order_is_the_servers(server: Server) -> None:
    native = server.post("/v1/embeddings", {"input": TEXTS[0], "encoding_format": "base64"})
    little = server.post(
        "/v1/embeddings", {"input": TEXTS[0], "encoding_format": "base64", "endianness": "little"}
    )
    # The test machine and the server are one machine, and it is little-endian.
    assert native.json()["data"][0]["embedding"] == little.json()["data"][0]["embedding"]


@pytest.mark.parametrize("precision", ["int8", "uint8", "binary", "ubinary"])
def test_quantized_embeddings(server: Server, precision: str) -> None:
    vectors = np.asarray(
        [d["embedding"] for d in server.post("/v1/embeddings", {"input": TEXTS}).json()["data"]],
        np.float32,
    )
    body = {"input": TEXTS, "precision": precision}
    got = [d["embedding"] for d in server.post("/v1/embeddings", body).json()["data"]]
    ranges = postprocess.unit_ranges(384) if precision.endswith("int8") else None
    expected = postprocess.quantize(vectors, precision, ranges)
    assert got == expected.tolist()
    packed = server.post("/v1/embeddings", {**body, "encoding_format": "base64"}).json()
    raw = [base64.b64decode(d["embedding"]) for d in packed["data"]]
    assert raw == [row.tobytes() for row in expected]
    if precision.endswith("int8"):
        calibrated = np.vstack((vectors.min(axis=0), vectors.max(axis=0)))
        body = {**body, "ranges": calibrated.tolist()}
        got = [d["embedding"] for d in server.post("/v1/embeddings", body).json()["data"]]
        assert got == postprocess.quantize(vectors, precision, calibrated).tolist()


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"precision": "int4"}, "precision"),
        ({"precision": "int8", "ranges": [[0.0] * 3, [1.0] * 3]}, "ranges"),
        ({"precision": "binary", "ranges": [[0.0] * 384, [1.0] * 384]}, "ranges"),
        ({"ranges": [[0.0] * 384, [1.0] * 384]}, "ranges"),
        ({"precision": "int8", "embed_dtype": "float16"}, "embed_dtype"),
        ({"endianness": "middle"}, "endianness"),
        ({"embed_dtype": "fp4"}, "embed_dtype"),
    ],
)
def test_bad_encodings(server: Server, body: dict, param: str) -> None:
    assert_error(server.post("/v1/embeddings", {"input": TEXTS, **body}), 400, param)


def test_invocations_dispatch_by_body_shape(
    server: Server, cross_server: Server, classifier_server: Server
) -> None:
    def same(srv: Server, body: dict, path: str, drop: tuple[str, ...] = ("id", "created")) -> None:
        got, want = srv.post("/invocations", body), srv.post(path, body)
        assert got.status_code == want.status_code == 200, got.text
        a, b = got.json(), want.json()
        if isinstance(a, dict):
            a, b = ({k: v for k, v in x.items() if k not in drop} for x in (a, b))
        assert a == b, path

    same(server, {"input": TEXTS}, "/v1/embeddings")
    same(server, {"input": TEXTS, "task": "token_embed"}, "/pooling")
    same(server, {"inputs": TEXTS}, "/embed")
    same(server, {"texts": TEXTS}, "/v2/embed")
    same(cross_server, {"query": QUERY, "documents": DOCS}, "/rerank")
    same(cross_server, {"query": QUERY, "texts": DOCS}, "/rerank")
    same(cross_server, {"queries": QUERY, "documents": DOCS}, "/score")
    same(cross_server, {"data_1": QUERY, "data_2": DOCS}, "/score")
    same(classifier_server, {"input": TEXTS}, "/classify")  # a classifier head: classify
    same(classifier_server, {"inputs": TEXTS[0]}, "/predict")
    message = assert_error(server.post("/invocations", {"prompt": "a"}), 400)
    assert "names no API" in message
    assert server.client.get("/ping").status_code == 200


def test_every_route_publishes_its_body_schema(server: Server) -> None:
    spec = server.client.get("/openapi.json").json()
    posts = {path: ops["post"] for path, ops in spec["paths"].items() if "post" in ops}
    assert set(posts) == {
        *("/v1/embeddings", "/embeddings", "/pooling", "/classify", "/score", "/v1/score"),
        *("/tokenize", "/detokenize"),
        *("/rerank", "/v1/rerank", "/v2/rerank", "/v1/embed", "/v2/embed", "/invocations"),
        *("/embed", "/embed_all", "/embed_sparse", "/predict", "/decode", "/"),
    }
    for path, op in posts.items():
        schema = op["requestBody"]["content"]["application/json"]["schema"]
        shapes = schema.get("anyOf", [schema])
        assert all(shape["properties"] for shape in shapes), path
        assert "$ref" not in json.dumps(schema), path
    shapes = posts["/v1/embeddings"]["requestBody"]["content"]["application/json"]["schema"]
    body, chat = shapes["anyOf"]  # input, or vLLM's messages
    assert {"input", "encoding_format", "dimensions", "precision"} <= set(body["properties"])
    assert {"add_special_tokens", "add_generation_prompt"} <= set(chat["properties"])
    assert body["required"] == ["input"] and chat["required"] == ["messages"]
    score = posts["/score"]["requestBody"]["content"]["application/json"]["schema"]["anyOf"]
    assert [sorted(s["required"]) for s in score] == [
        ["text_1", "text_2"],
        ["data_1", "data_2"],
        ["documents", "queries"],
        ["items", "queries"],
    ]
    assert server.client.get("/docs").status_code == 200


def test_embedding_use_activation_is_vllms_normalize(
    server: Server, minilm: vecpool.Engine
) -> None:
    body = {"input": TEXTS, "use_activation": False, "priority": 3}
    response = server.post("/v1/embeddings", body)
    assert response.status_code == 200, response.text
    got = np.asarray([d["embedding"] for d in response.json()["data"]], np.float32)
    assert np.abs(got - minilm.embed(TEXTS, normalize=False)).max() <= 1e-6
    contradiction = {"input": TEXTS, "use_activation": False, "normalize": True}
    assert_error(server.post("/v1/embeddings", contradiction), 400, "use_activation")
    assert server.client.get("/").status_code == 200  # TEI's health check at the root


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/rerank", {"query": QUERY, "documents": DOCS}),
        ("/score", {"text_1": QUERY, "text_2": DOCS}),
        ("/classify", {"input": DOCS}),
    ],
)
def test_fields_a_route_does_not_use_are_refused(
    cross_server: Server, path: str, body: dict
) -> None:
    message = assert_error(
        cross_server.post(path, {**body, "prompt_name": "query"}), 400, "prompt_name"
    )
    assert "not permitted" in message
