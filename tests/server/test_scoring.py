"""Rerank (Cohere and Jina shapes), score and classify over HTTP: with the default embedding
model (cosine scores) and with a tiny cross-encoder (its classifier's scores)."""

from __future__ import annotations

import numpy as np
import pytest

import vecpool
from tests.server.conftest import Server, assert_error

QUERY = "what do cats eat"
DOCS = [
    "the stock market fell sharply on monday",
    "a cat is a small carnivorous mammal that eats mice",
    "pizza",
    "cats eat fish and mice",
]


def check_ranking(body: dict, expected: list[tuple[int, float]], documents: bool) -> None:
    results = body["results"]
    assert [r["index"] for r in results] == [i for i, _ in expected]
    got = np.array([r["relevance_score"] for r in results])
    assert np.abs(got - np.array([s for _, s in expected])).max() <= 1e-5
    for r in results:
        assert ("document" in r) == documents
        if documents:
            assert r["document"] == {"text": DOCS[r["index"]]}


@pytest.mark.parametrize("path", ["/rerank", "/v1/rerank", "/v2/rerank"])
def test_rerank_cohere_and_jina_shapes(
    server: Server,
    minilm: vecpool.Engine,
    cross_server: Server,
    cross_engine: vecpool.Engine,
    path: str,
) -> None:
    for srv, engine in ((server, minilm), (cross_server, cross_engine)):
        expected = engine.rerank(QUERY, DOCS)
        # Cohere: documents as strings, top_n, return_documents false.
        cohere = srv.post(
            path, {"query": QUERY, "documents": DOCS, "top_n": 2, "return_documents": False}
        )
        assert cohere.status_code == 200, cohere.text
        check_ranking(cohere.json(), expected[:2], documents=False)
        # Jina: documents as {"text": ...} objects, the documents returned.
        jina = srv.post(path, {"query": QUERY, "documents": [{"text": d} for d in DOCS]})
        assert jina.status_code == 200, jina.text
        check_ranking(jina.json(), expected, documents=True)
        # top_n 0 is every document, as null is (and as vLLM reads it).
        every = srv.post(path, {"query": QUERY, "documents": DOCS, "top_n": 0})
        check_ranking(every.json(), expected, documents=True)
        assert jina.json()["usage"]["total_tokens"] == int(jina.headers["x-prompt-tokens"]) > 0


def test_score(
    server: Server, minilm: vecpool.Engine, cross_server: Server, cross_engine: vecpool.Engine
) -> None:
    for srv, engine in ((server, minilm), (cross_server, cross_engine)):
        one_to_many = srv.post("/score", {"text_1": QUERY, "text_2": DOCS})
        assert one_to_many.status_code == 200, one_to_many.text
        got = np.array([d["score"] for d in one_to_many.json()["data"]])
        assert np.abs(got - engine.score(QUERY, DOCS)).max() <= 1e-5
        pairwise = srv.post("/score", {"text_1": [QUERY, DOCS[0]], "text_2": DOCS[1:3]})
        got = np.array([d["score"] for d in pairwise.json()["data"]])
        assert np.abs(got - engine.score([QUERY, DOCS[0]], DOCS[1:3])).max() <= 1e-5
    raw = cross_server.post("/score", {"text_1": QUERY, "text_2": DOCS, "use_activation": False})
    got = np.array([d["score"] for d in raw.json()["data"]])
    assert np.abs(got - cross_engine.score(QUERY, DOCS, use_activation=False)).max() <= 1e-5


def test_classify(cross_server: Server, cross_engine: vecpool.Engine) -> None:
    inputs = [DOCS[0], {"text": QUERY, "text_pair": DOCS[1]}, cross_engine.tokenize(DOCS[2])]
    response = cross_server.post("/classify", {"model": "ce", "input": inputs})
    assert response.status_code == 200, response.text
    data = response.json()["data"]
    assert [d["label"] for d in data] == ["relevant"] * 3
    assert all(d["num_classes"] == 1 for d in data)
    got = np.array([d["probs"] for d in data])
    assert np.abs(got - cross_engine.classify(inputs)).max() <= 1e-5
    pooled = cross_server.post("/pooling", {"input": inputs, "task": "classify"})
    assert np.abs(np.array([d["data"] for d in pooled.json()["data"]]) - got).max() <= 1e-6


def test_task_the_model_lacks(server: Server) -> None:
    message = assert_error(server.post("/classify", {"input": ["a"]}), 400, "task")
    assert "cannot serve task 'classify'" in message
    message = assert_error(server.post("/pooling", {"input": ["a"], "task": "sparse"}), 400, "task")
    assert "cannot serve task 'sparse'" in message


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/rerank", {"query": "q", "documents": []}, "documents"),
        ("/v1/rerank", {"query": "q", "documents": [5]}, "documents[0]"),
        (
            "/v2/rerank",
            {"query": "q", "documents": ["a"], "truncate_prompt_tokens": 10**6},
            "truncate_prompt_tokens",
        ),
        ("/v2/rerank", {"query": "q", "documents": ["a"], "top_n": -1}, "top_n"),
        ("/v2/rerank", {"query": "q", "documents": ["a"], "top_n": 1.5}, "top_n"),
        ("/v2/rerank", {"documents": ["a"]}, "query"),
        ("/v2/rerank", {"query": "", "documents": ["a"]}, "query"),
        ("/v2/rerank", {"query": "q", "documents": ["a", ""]}, "documents[1]"),
        ("/score", {"text_1": ["a", "b", "c"], "text_2": ["a", "b"]}, "text_1"),
        ("/score", {"text_1": "a", "text_2": []}, "text_2"),
        ("/classify", {"input": []}, "input"),
        ("/classify", {"input": ["a", 3]}, "input[1]"),
        ("/classify", {"input": ["a", {"text": "a", "text_pair": 3}]}, "input[1].text_pair"),
    ],
)
def test_bad_scoring_requests(cross_server: Server, path: str, body: dict, param: str) -> None:
    assert_error(cross_server.post(path, body), 400, param)


def test_use_activation_of_cosine_scores_is_refused_naming_the_field(server: Server) -> None:
    """An embedding model's scores are cosines: `use_activation` has no activation to switch,
    and the 400 names the request's field as sent."""
    for path, body in (
        ("/score", {"text_1": QUERY, "text_2": DOCS, "use_activation": True}),
        ("/rerank", {"query": QUERY, "documents": DOCS, "use_activation": True}),
    ):
        message = assert_error(server.post(path, body), 400, "use_activation")
        assert "use_activation applies to cross-encoder and LLM scores" in message
