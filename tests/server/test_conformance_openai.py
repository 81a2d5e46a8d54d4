"""OpenAI's documented behaviour of the embeddings API, one expectation a test.

Sources: OpenAI's API reference ("Embeddings": create, the embedding object, `dimensions`,
`encoding_format`; "Models": list; "Error codes") and its embeddings guide (the example input
"The food was delicious and the waiter...").
"""

from __future__ import annotations

import base64

import numpy as np

import vecpool
from tests.server.conformance import MODEL, ask

TEXT = "The food was delicious and the waiter..."


def test_openai_create_embedding_example(tiny_embed_engine: vecpool.Engine) -> None:
    # The embedding object: {"object": "embedding", "embedding", "index"} in a "list".
    response = ask(tiny_embed_engine, "/v1/embeddings", {"model": MODEL, "input": TEXT})
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["object"] == "list" and body["model"] == MODEL
    (item,) = body["data"]
    assert item["object"] == "embedding" and item["index"] == 0
    got = np.asarray(item["embedding"], dtype=np.float32)
    assert np.abs(got - tiny_embed_engine.embed([TEXT])[0]).max() <= 1e-6
    tokens = len(tiny_embed_engine.tokenize(TEXT))
    assert body["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens}


def test_openai_encoding_format_base64_is_little_endian_float32(
    tiny_embed_engine: vecpool.Engine,
) -> None:
    body = {"input": [TEXT, "hello"], "encoding_format": "base64"}
    data = ask(tiny_embed_engine, "/v1/embeddings", body).json()["data"]
    got = np.stack([np.frombuffer(base64.b64decode(d["embedding"]), "<f4") for d in data])
    assert np.abs(got - tiny_embed_engine.embed([TEXT, "hello"])).max() <= 1e-6


def test_openai_token_array_input(tiny_embed_engine: vecpool.Engine) -> None:
    # `input` may be an array of tokens (or of token arrays).
    ids = tiny_embed_engine.tokenize(TEXT)
    data = ask(tiny_embed_engine, "/v1/embeddings", {"input": [ids]}).json()["data"]
    assert (
        np.abs(np.asarray(data[0]["embedding"]) - tiny_embed_engine.embed([TEXT])[0]).max() <= 1e-6
    )


def test_openai_dimensions_only_for_a_model_trained_for_them(
    tiny_embed_engine: vecpool.Engine, chat_engine: vecpool.Engine
) -> None:
    # `dimensions` is "only supported in text-embedding-3 and later models": others refuse.
    refused = ask(tiny_embed_engine, "/v1/embeddings", {"input": TEXT, "dimensions": 8})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "dimensions"
    cut = ask(chat_engine, "/v1/embeddings", {"input": TEXT, "dimensions": 8})
    assert len(cut.json()["data"][0]["embedding"]) == 8


def test_openai_error_object(tiny_embed_engine: vecpool.Engine) -> None:
    # Errors: {"error": {"message", "type", "param", "code"}}; too long says "maximum context
    # length" (what clients match on to shorten their input).
    response = ask(tiny_embed_engine, "/v1/embeddings", {"input": "word " * 300})
    assert response.status_code == 400
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and "maximum context length" in error["message"]


def test_openai_unknown_model_is_a_404(tiny_embed_engine: vecpool.Engine) -> None:
    response = ask(tiny_embed_engine, "/v1/embeddings", {"input": TEXT, "model": "nope"})
    assert response.status_code == 404 and response.json()["error"]["code"] == "model_not_found"


def test_openai_models_list(tiny_embed_engine: vecpool.Engine) -> None:
    # Models: list -> {"object": "list", "data": [{"id", "object": "model", "created",
    # "owned_by"}]}.
    body = ask(tiny_embed_engine, "/v1/models").json()
    assert body["object"] == "list"
    (model,) = body["data"]
    assert model["id"] == MODEL and model["object"] == "model"
    assert isinstance(model["created"], int) and isinstance(model["owned_by"], str)
