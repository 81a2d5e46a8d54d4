"""Text Embeddings Inference's documented behaviour, one expectation a test.

Sources: TEI's OpenAPI document (its request examples: "What is Deep Learning?", "I like
you.", the rerank texts "Deep Learning is not..." / "Deep learning is..."; its error schema
`{"error", "error_type"}` and statuses) and its README's quick-tour requests.
"""

from __future__ import annotations

import numpy as np
import pytest

import vecpool
from tests.server.conformance import ask

INPUT = "What is Deep Learning?"
TEXTS = ["Deep Learning is not...", "Deep learning is..."]


def test_tei_embed_example(tiny_embed_engine: vecpool.Engine) -> None:
    # POST /embed {"inputs": "What is Deep Learning?"} -> [[float]] (normalized by default).
    response = ask(tiny_embed_engine, "/embed", {"inputs": INPUT})
    assert response.status_code == 200, response.text
    got = np.asarray(response.json(), dtype=np.float32)
    assert got.shape == (1, tiny_embed_engine.info().output_dim)
    assert np.abs(got - tiny_embed_engine.embed([INPUT])).max() <= 1e-6


def test_tei_embed_batch_not_normalized(tiny_embed_engine: vecpool.Engine) -> None:
    body = {"inputs": [INPUT, TEXTS[0]], "normalize": False}
    got = np.asarray(ask(tiny_embed_engine, "/embed", body).json(), dtype=np.float32)
    expected = tiny_embed_engine.embed([INPUT, TEXTS[0]], normalize=False)
    assert np.abs(got - expected).max() <= 1e-5


def test_tei_rerank_example(cross_engine: vecpool.Engine) -> None:
    # POST /rerank {"query", "texts"} -> [{"index", "score"}] best first.
    response = ask(cross_engine, "/rerank", {"query": INPUT, "texts": TEXTS})
    assert response.status_code == 200, response.text
    expected = cross_engine.rerank(INPUT, TEXTS)
    got = response.json()
    assert [r["index"] for r in got] == [i for i, _ in expected]
    assert np.abs(np.array([r["score"] for r in got]) - [s for _, s in expected]).max() <= 1e-6


def test_tei_predict_example(classifier_engine: vecpool.Engine) -> None:
    # POST /predict {"inputs": "I like you."} -> [{"score", "label"}] best first.
    response = ask(classifier_engine, "/predict", {"inputs": "I like you."})
    assert response.status_code == 200, response.text
    got = response.json()
    probs = classifier_engine.classify(["I like you."])[0]
    assert [p["score"] for p in got] == sorted((p["score"] for p in got), reverse=True)
    assert np.abs(np.sort([p["score"] for p in got]) - np.sort(probs)).max() <= 1e-6


def test_tei_too_long_is_a_413_validation_error(tiny_embed_engine: vecpool.Engine) -> None:
    # ErrorResponse {"error", "error_type": "validation"}, 413 for an input over the limit.
    response = ask(tiny_embed_engine, "/embed", {"inputs": "word " * 300, "truncate": False})
    assert response.status_code == 413, response.text
    assert response.json()["error_type"] == "validation"


def test_tei_empty_batch_is_a_400(tiny_embed_engine: vecpool.Engine) -> None:
    response = ask(tiny_embed_engine, "/embed", {"inputs": []})
    assert response.status_code == 400 and response.json()["error_type"] == "empty"


@pytest.mark.xfail(
    strict=True,
    reason="choice: vecpool reranks with any model (an embedding model by the cosine of its "
    "vectors), in TEI's answer shape; TEI needs a one-label cross-encoder",
)
def test_tei_rerank_on_an_embedding_model_is_a_424(tiny_embed_engine: vecpool.Engine) -> None:
    # TEI's router: "model is not a re-ranker model", 424 backend.
    response = ask(tiny_embed_engine, "/rerank", {"query": INPUT, "texts": TEXTS})
    assert response.status_code == 424, response.text


def test_tei_health_and_info(tiny_embed_engine: vecpool.Engine) -> None:
    assert ask(tiny_embed_engine, "/health").status_code == 200
    info = ask(tiny_embed_engine, "/info").json()
    assert info["max_input_length"] == tiny_embed_engine.info().max_model_len
    assert "embedding" in info["model_type"]
