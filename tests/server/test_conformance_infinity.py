"""Infinity's documented behaviour, one expectation a test.

Sources (Infinity's own code and documentation): `infinity_server.py` (its routes, their
docstring examples, the errors it raises), `fastapi_schemas/pymodels.py` (the request and
answer models: `RerankInput`, `ClassifyInput`, `ClassifyResult`, `ReRankResult`, `ModelInfo`),
and the README's request examples. Infinity's generated Python client always sends
`raw_scores` with rerank and classify: that key is what marks a body as Infinity's where its
paths are shared with vLLM's.
"""

from __future__ import annotations

import numpy as np
import pytest

import vecpool
from tests.server.conformance import MODEL, ask, error_message

QUERY = "Where is Munich?"  # the /rerank docstring's example
DOCS = ["Munich is in Germany.", "The sky is blue."]
SENTENCES = ["Two cute cats.", "I am not having a great day."]
LONG = "word " * 300


def test_infinity_embeddings_example(tiny_embed_engine: vecpool.Engine) -> None:
    # POST /embeddings {"model", "input": [...]}: OpenAI's answer.
    response = ask(tiny_embed_engine, "/embeddings", {"model": MODEL, "input": SENTENCES})
    assert response.status_code == 200, response.text
    body = response.json()
    got = np.asarray([d["embedding"] for d in body["data"]], dtype=np.float32)
    assert np.abs(got - tiny_embed_engine.embed(SENTENCES)).max() <= 1e-6
    assert [d["index"] for d in body["data"]] == [0, 1]
    assert body["usage"]["prompt_tokens"] == body["usage"]["total_tokens"] > 0


def test_infinity_embeddings_dimensions_cut_any_model(tiny_embed_engine: vecpool.Engine) -> None:
    # Infinity cuts the vectors of any model to `dimensions` (it does not check matryoshka).
    body = {"input": SENTENCES, "dimensions": 8}
    response = ask(tiny_embed_engine, "/embeddings", body)
    assert response.status_code == 200, response.text
    got = np.asarray([d["embedding"] for d in response.json()["data"]], dtype=np.float32)
    assert np.abs(got - tiny_embed_engine.embed(SENTENCES, dimensions=8)).max() <= 1e-6


def test_infinity_over_long_input_is_a_422(tiny_embed_engine: vecpool.Engine) -> None:
    # Inputs Infinity's models refuse are FastAPI validation errors: 422.
    response = ask(tiny_embed_engine, "/embeddings", {"input": [LONG]})
    assert response.status_code == 422, response.text
    assert "maximum context length" in error_message(response)


def test_infinity_empty_input_list_is_a_422(tiny_embed_engine: vecpool.Engine) -> None:
    # `input`: conlist(min_length=1).
    assert ask(tiny_embed_engine, "/embeddings", {"input": []}).status_code == 422


def test_infinity_models_without_v1_with_stats(tiny_embed_engine: vecpool.Engine) -> None:
    # GET /models: {"data": [{"id", "stats": {queue_fraction, queue_absolute, results_pending,
    # batch_size}, "object": "model", "owned_by", "created", "backend", "capabilities"}]}.
    response = ask(tiny_embed_engine, "/models")
    assert response.status_code == 200
    (model,) = response.json()["data"]
    assert model["id"] == MODEL and model["object"] == "model"
    assert set(model["stats"]) == {
        "queue_fraction",
        "queue_absolute",
        "results_pending",
        "batch_size",
    }
    assert model["stats"]["queue_absolute"] == 0 and model["stats"]["batch_size"] > 0
    assert model["capabilities"] == ["embed"] and isinstance(model["backend"], str)


def test_infinity_models_capabilities_of_a_reranker(cross_engine: vecpool.Engine) -> None:
    (model,) = ask(cross_engine, "/models").json()["data"]
    assert model["capabilities"] == ["rerank"]


def test_infinity_health_is_a_unix_timestamp(tiny_embed_engine: vecpool.Engine) -> None:
    # GET /health -> {"unix": time.time()}.
    import time

    before = time.time()
    response = ask(tiny_embed_engine, "/health")
    assert response.status_code == 200
    assert before <= response.json()["unix"] <= time.time()  # read meanwhile


def test_infinity_rerank_example(cross_engine: vecpool.Engine) -> None:
    # ReRankResult: {"object": "rerank", "results": [{relevance_score, index, document}]},
    # best first; `document` null unless return_documents (a string then).
    body = {"model": MODEL, "query": QUERY, "documents": DOCS, "raw_scores": False}
    response = ask(cross_engine, "/rerank", body)
    assert response.status_code == 200, response.text
    result = response.json()
    assert result["object"] == "rerank"
    expected = cross_engine.rerank(QUERY, DOCS)
    assert [r["index"] for r in result["results"]] == [i for i, _ in expected]
    scores = [r["relevance_score"] for r in result["results"]]
    assert np.abs(np.array(scores) - [s for _, s in expected]).max() <= 1e-6
    assert all(r["document"] is None for r in result["results"])
    shown = ask(cross_engine, "/rerank", {**body, "return_documents": True, "top_n": 1})
    (top,) = shown.json()["results"]
    assert top["document"] == DOCS[expected[0][0]]


def test_infinity_rerank_raw_scores_are_logits(cross_engine: vecpool.Engine) -> None:
    body = {"query": QUERY, "documents": DOCS, "raw_scores": True}
    results = ask(cross_engine, "/rerank", body).json()["results"]
    expected = cross_engine.rerank(QUERY, DOCS, use_activation=False)
    assert (
        np.abs(np.array([r["relevance_score"] for r in results]) - [s for _, s in expected]).max()
        <= 1e-6
    )


def test_infinity_rerank_by_an_embedding_model(tiny_embed_engine: vecpool.Engine) -> None:
    # Infinity's client sends raw_scores false: the model's own scores, here cosines (no
    # activation to apply or leave out).
    body = {"model": MODEL, "query": QUERY, "documents": DOCS, "raw_scores": False}
    response = ask(tiny_embed_engine, "/rerank", body)
    assert response.status_code == 200, response.text
    expected = tiny_embed_engine.rerank(QUERY, DOCS)
    results = response.json()["results"]
    assert [r["index"] for r in results] == [i for i, _ in expected]
    assert np.abs([r["relevance_score"] for r in results] - np.array(expected)[:, 1]).max() <= 1e-6


@pytest.mark.parametrize("top_n", [0, -1])
def test_infinity_rerank_top_n_not_above_zero_is_a_422(
    cross_engine: vecpool.Engine, top_n: int
) -> None:
    # RerankInput.top_n: Field(gt=0).
    body = {"query": QUERY, "documents": DOCS, "raw_scores": False, "top_n": top_n}
    response = ask(cross_engine, "/rerank", body)
    assert response.status_code == 422, response.text
    assert response.json()["error"]["param"] == "top_n"


def test_infinity_over_long_inputs_on_rerank_and_classify_are_422s(
    cross_engine: vecpool.Engine, classifier_engine: vecpool.Engine
) -> None:
    # The same FastAPI validation as /embeddings', on its bodies of the shared paths.
    rerank = {"query": QUERY, "documents": [LONG, DOCS[0]], "raw_scores": False}
    assert ask(cross_engine, "/rerank", rerank).status_code == 422
    classify = {"input": [SENTENCES[0], LONG], "raw_scores": False}
    response = ask(classifier_engine, "/classify", classify)
    assert response.status_code == 422, response.text
    assert "maximum context length" in error_message(response)


def test_infinity_rerank_documents_as_one_string_is_a_422(cross_engine: vecpool.Engine) -> None:
    # RerankInput.documents: a list of strings.
    body = {"query": QUERY, "documents": DOCS[0], "raw_scores": False}
    assert ask(cross_engine, "/rerank", body).status_code == 422


def test_infinity_reranker_asked_to_embed(cross_engine: vecpool.Engine) -> None:
    # 400 "ModelNotDeployedError: model=... does not support `embed`".
    response = ask(cross_engine, "/embeddings", {"model": MODEL, "input": SENTENCES})
    assert response.status_code == 400
    assert error_message(response).startswith("ModelNotDeployedError")


def test_infinity_reranker_asked_to_classify(cross_engine: vecpool.Engine) -> None:
    body = {"model": MODEL, "input": SENTENCES, "raw_scores": False}
    response = ask(cross_engine, "/classify", body)
    assert response.status_code == 400
    assert "does not support classify" in error_message(response)


def test_infinity_classify_data_shape(classifier_engine: vecpool.Engine) -> None:
    # ClassifyResult: {"object": "classify", "data": [[{"score", "label"}, ...] per input]},
    # every label, best first.
    body = {"model": MODEL, "input": SENTENCES, "raw_scores": False}
    response = ask(classifier_engine, "/classify", body)
    assert response.status_code == 200, response.text
    result = response.json()
    assert result["object"] == "classify"
    expected = classifier_engine.classify(SENTENCES)
    labels = ["negative", "positive"]
    for row, probs in zip(result["data"], expected, strict=True):
        order = np.argsort(-probs, kind="stable")
        assert [item["label"] for item in row] == [labels[j] for j in order]
        assert np.abs(np.array([item["score"] for item in row]) - probs[order]).max() <= 1e-6
    raw = ask(classifier_engine, "/classify", {**body, "raw_scores": True}).json()["data"]
    logits = classifier_engine.classify(SENTENCES, use_activation=False)
    assert (
        np.abs(np.sort([i["score"] for i in raw[0]])[::-1] - np.sort(logits[0])[::-1]).max() <= 1e-6
    )


@pytest.mark.xfail(
    strict=True,
    reason="conflict: a rerank body without raw_scores is vLLM's / Cohere's on the shared "
    '/rerank path, answered with `document` as {"text"} and returned by default',
)
def test_infinity_rerank_without_raw_scores_returns_no_documents(
    cross_engine: vecpool.Engine,
) -> None:
    # The README's curl example sends only model, query and documents.
    result = ask(cross_engine, "/rerank", {"model": MODEL, "query": QUERY, "documents": DOCS})
    assert all(r.get("document") is None for r in result.json()["results"])
