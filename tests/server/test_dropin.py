"""What the peers' own test suites assert, against live servers: vLLM's error bodies on its
routes (`type` BadRequestError, the status as `code`, pydantic's error type for a bad value),
its `--chat-template` for every model served, tasks a model was not made for refused unless
`--task` asks for them (and vLLM's `token_classify` on a sequence classifier once asked),
vLLM's words for too-long inputs and truncation sizes on /score and /rerank, and Infinity's
statuses and shapes on its bodies. Each answer in the dialect of its route and body shape."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import transformers

import vecpool
from tests.server.conftest import (
    CHAT_TEMPLATE,
    Server,
    ServerPool,
    ServerSpec,
    assert_error,
)
from vecpool.calls.chat import read_chat_template

QUERY = "What is the capital of France?"
DOCS = ["The capital of Brazil is Brasilia.", "The capital of France is Paris."]
LONG = "word " * 300  # over the test models' limits (128 and 512 tokens)
MESSAGES = [
    {"role": "system", "content": "Represent the question for retrieval."},
    {"role": "user", "content": QUERY},
]
# The template the server is given (vLLM's own tests pass one like it): other words than the
# folder's own, so that which template ran shows in the tokens.
FLAG_TEMPLATE = "{% for m in messages %}<{{ m['role'] }}> {{ m['content'] }}\\n{% endfor %}"
# The server's answers against an engine in this process on the same weights: the same float32
# computation but for the JSON round trip of each value.
TOL = 1e-6


def vllm_body(response: Any, status: int, kind: str) -> dict[str, Any]:
    """vLLM's error body with `status` and `type` `kind`: its `error` object."""
    assert response.status_code == status, response.text
    error: dict[str, Any] = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == kind and error["code"] == status, error
    return error


def vectors(response: Any) -> np.ndarray:
    assert response.status_code == 200, response.text
    return np.asarray([d["embedding"] for d in response.json()["data"]], dtype=np.float32)


# ---- 1. vLLM's error bodies --------------------------------------------------------------


@pytest.mark.parametrize("field", ["encoding_format", "embed_dtype", "endianness"])
def test_vllm_a_bad_value_names_pydantics_error_type(server: Server, field: str) -> None:
    # vLLM's test_params_not_supported: 400, "literal_error" and the value in the message.
    body = {"input": "a", "encoding_format": "base64", field: f"bad_{field}"}
    error = vllm_body(server.post("/pooling", body), 400, "Bad Request")
    assert "literal_error" in error["message"] and f"bad_{field}" in error["message"]
    assert error["param"] == field
    # OpenAI's route keeps OpenAI's shape: its type, pydantic's error type as `code`.
    openai = server.post("/v1/embeddings", body)
    assert_error(openai, 400, field)
    assert openai.json()["error"]["code"] == "literal_error"


def test_vllm_routes_answer_bad_request_error(server: Server, classifier_server: Server) -> None:
    error = vllm_body(
        server.post("/pooling", {"input": "a", "task": "summarize"}), 400, "BadRequestError"
    )
    assert "unknown task 'summarize'" in error["message"] and error["param"] == "task"
    for path, body in (
        ("/score", {"text_1": QUERY, "text_2": []}),
        ("/rerank", {"query": QUERY, "documents": []}),
        ("/v1/rerank", {"query": QUERY, "documents": []}),
        ("/v2/rerank", {"query": QUERY, "documents": []}),
        ("/classify", {"input": []}),
        ("/tokenize", {"prompt": ""}),
        ("/detokenize", {"tokens": [10**9]}),
    ):
        vllm_body(server.post(path, body), 400, "BadRequestError")
    missing = server.post("/pooling", {"input": "a", "model": "nothing"})
    assert vllm_body(missing, 404, "NotFoundError")["param"] == "model"
    # A model that scores no pairs: vLLM has no such route for it (FastAPI's 404 body).
    refused = classifier_server.post("/score", {"text_1": QUERY, "text_2": DOCS})
    vllm_body(refused, 404, "NotFoundError")
    assert refused.json()["detail"] == "Not Found"


def test_other_peers_keep_their_shapes_on_vllms_paths(server: Server, cross_server: Server) -> None:
    # TEI's body on /rerank: TEI's error shape.
    tei = server.post("/rerank", {"query": QUERY, "texts": []})
    assert tei.status_code == 400, tei.text
    assert set(tei.json()) == {"error", "error_type"} and tei.json()["error_type"] == "empty"
    # Infinity's body (raw_scores): a 422 in OpenAI's shape, as its FastAPI answers.
    body = {"query": QUERY, "documents": DOCS, "raw_scores": False, "top_n": 0}
    infinity = cross_server.post("/rerank", body)
    assert infinity.status_code == 422, infinity.text
    assert infinity.json()["error"]["type"] == "invalid_request_error"
    assert infinity.json()["error"]["param"] == "top_n"


# ---- 2. --chat-template, and 3. --task ---------------------------------------------------


def _flagged_args(folder: Path, chat_matryoshka_dir: Path, cross_encoder_dir: Path) -> list[str]:
    """A model with a chat template of its own ("chat") and a cross-encoder without one
    ("ce", asked to embed and to classify tokens), both given `--chat-template` (a file in
    `folder`, holding the text it reads as)."""
    template = folder / "template.jinja"
    template.write_text(read_chat_template(FLAG_TEMPLATE))
    return [
        str(chat_matryoshka_dir),
        str(cross_encoder_dir),
        *("--served-model-name", "chat", "--served-model-name", "ce"),
        *("--task", "none", "--task", "embed,token_classify"),
        *("--chat-template", str(template)),
    ]


SERVERS = {
    "flagged": ServerSpec(_flagged_args, fixtures=("chat_matryoshka_dir", "cross_encoder_dir"))
}


@pytest.fixture(scope="module")
def flagged(server_pool: ServerPool, request: pytest.FixtureRequest) -> Iterator[Server]:
    srv = server_pool.take(request, "flagged")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def template_file(server_pool: ServerPool, request: pytest.FixtureRequest) -> Path:
    """The file `--chat-template` names."""
    return server_pool.folder(request, "flagged") / "template.jinja"


@pytest.fixture(scope="module")
def asked(cross_encoder_dir: Path) -> vecpool.Engine:
    """The cross-encoder in this process, asked for what `flagged` serves it for."""
    return vecpool.Engine(cross_encoder_dir, device="cpu", tasks=["embed", "token_classify"])


def _rendered_ids(folder: Path, template: str) -> list[int]:
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    text = tokenizer.apply_chat_template(MESSAGES, chat_template=template, tokenize=False)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def test_chat_template_flag_renders_messages_for_every_model(
    flagged: Server,
    chat_matryoshka_dir: Path,
    cross_encoder_dir: Path,
    template_file: Path,
    chat_engine: vecpool.Engine,
    asked: vecpool.Engine,
) -> None:
    template = template_file.read_text()
    assert "\n" in template and "\\n" not in template  # the text's escape read as vLLM reads it
    for model, folder, engine in (
        ("chat", chat_matryoshka_dir, chat_engine),
        ("ce", cross_encoder_dir, asked),
    ):
        ids = _rendered_ids(folder, template)
        got = vectors(flagged.post("/v1/embeddings", {"model": model, "messages": MESSAGES}))
        assert np.abs(got - engine.embed([ids])).max() <= TOL, model
    # The folder's own template is replaced, not used: its rendering differs.
    own = _rendered_ids(chat_matryoshka_dir, CHAT_TEMPLATE)
    assert own != _rendered_ids(chat_matryoshka_dir, template)
    # And /pooling, /classify take the same rendering.
    pooled = flagged.post("/pooling", {"model": "ce", "messages": MESSAGES, "task": "embed"})
    assert pooled.status_code == 200, pooled.text
    classified = flagged.post("/classify", {"model": "ce", "messages": MESSAGES})
    ids = _rendered_ids(cross_encoder_dir, template)
    assert (
        np.abs(np.array(classified.json()["data"][0]["probs"]) - asked.classify([ids])[0]).max()
        <= TOL
    )


def test_chat_template_text_and_refusals() -> None:
    assert (
        read_chat_template("{{ messages[0]['content'] }}\\t!") == "{{ messages[0]['content'] }}\t!"
    )
    with pytest.raises(vecpool.ConfigError, match="looks like a file path"):
        read_chat_template("no/such/template.jinja")
    with pytest.raises(vecpool.ConfigError, match="chat_template: line 1"):
        vecpool.Engine(device="cpu", chat_template="{% for m in messages %}", tokenizer_processes=0)


def test_a_cross_encoder_refuses_to_embed_unless_asked(
    cross_server: Server, flagged: Server, cross_engine: vecpool.Engine, asked: vecpool.Engine
) -> None:
    # Not asked: every embedding route refuses, each in its dialect, saying how to ask.
    openai = assert_error(cross_server.post("/v1/embeddings", {"input": DOCS}), 400, "task")
    assert "Unsupported task: 'embed'" in openai and "--task embed" in openai
    for task in ("embed", "token_embed"):
        error = vllm_body(
            cross_server.post("/pooling", {"input": QUERY, "task": task}), 400, "BadRequestError"
        )
        assert error["message"].startswith(f"Unsupported task: {task!r}")
    switch = cross_server.post("/pooling", {"input": QUERY, "task": "token_classify"})
    error = vllm_body(switch, 400, "BadRequestError")
    assert error["message"].startswith("Try switching the model's pooling_task via")
    assert "--task token_classify" in error["message"]
    tei = cross_server.post("/embed", {"inputs": QUERY})
    assert tei.status_code == 424 and tei.json()["error_type"] == "backend"
    cohere = cross_server.post("/v2/embed", {"texts": DOCS, "embedding_types": ["float"]})
    assert cohere.status_code == 400 and set(cohere.json()) == {"id", "message"}
    assert "Unsupported task: 'embed'" in cohere.json()["message"]
    infinity = cross_server.post("/embeddings", {"input": DOCS})
    assert infinity.status_code == 400
    assert infinity.json()["error"]["message"].startswith("ModelNotDeployedError")
    assert cross_server.client.get("/v1/models").json()["data"][0]["capabilities"] == ["rerank"]
    # Asked (--task embed,token_classify): served, as the engine serves them.
    got = vectors(flagged.post("/v1/embeddings", {"model": "ce", "input": DOCS}))
    assert np.abs(got - asked.embed(DOCS)).max() <= TOL
    rows = flagged.post("/pooling", {"model": "ce", "input": DOCS, "task": "token_classify"})
    assert rows.status_code == 200, rows.text
    expected = asked.encode(DOCS, task="token_classify")
    for item, want in zip(rows.json()["data"], expected, strict=True):
        assert (
            np.asarray(item["data"]).shape
            == want.shape
            == (len(cross_engine.tokenize(DOCS[item["index"]])), 1)
        )
        assert np.abs(np.asarray(item["data"]) - want).max() <= TOL
    # What it was made for is unchanged.
    scored = flagged.post("/score", {"model": "ce", "text_1": QUERY, "text_2": DOCS})
    assert (
        np.abs(
            np.array([d["score"] for d in scored.json()["data"]]) - cross_engine.score(QUERY, DOCS)
        ).max()
        <= TOL
    )


# ---- 4. too long, and truncation sizes, on /score and /rerank ---------------------------


def test_vllm_words_for_too_long_and_truncation_sizes(cross_server: Server) -> None:
    limit = cross_server.post("/tokenize", {"prompt": "a"}).json()["max_model_len"]
    for path, body in (
        ("/score", {"queries": LONG, "documents": DOCS}),
        ("/rerank", {"query": QUERY, "documents": [LONG, DOCS[0]]}),
    ):
        error = vllm_body(cross_server.post(path, body), 400, "BadRequestError")
        assert "Please reduce the length of the input prompt." in error["message"]
        assert "maximum context length" in error["message"]
        truncated = cross_server.post(path, {**body, "truncate_prompt_tokens": limit + 1})
        error = vllm_body(truncated, 400, "BadRequestError")
        assert "Please request a smaller truncation size." in error["message"]
        assert error["param"] == "truncate_prompt_tokens"
    # /classify, vLLM's too, in the same words.
    classify = cross_server.post("/classify", {"input": [LONG]})
    error = vllm_body(classify, 400, "BadRequestError")
    assert "Please reduce the length of the input prompt." in error["message"]
    assert error["param"] == "input[0]"


def test_openai_route_too_long_keeps_its_words(server: Server) -> None:
    message = assert_error(server.post("/v1/embeddings", {"input": [LONG * 2]}), 400, "input[0]")
    assert "maximum context length" in message
    assert "Please reduce the length of the input." in message


# ---- 5. Infinity --------------------------------------------------------------------------


def test_infinity_statuses_and_shapes(
    server: Server, cross_server: Server, classifier_server: Server, cross_engine: vecpool.Engine
) -> None:
    # A too-long input is a 422 on each of its routes.
    assert server.post("/embeddings", {"input": [LONG * 2]}).status_code == 422
    long_rerank = {"query": QUERY, "documents": [LONG], "raw_scores": False}
    assert cross_server.post("/rerank", long_rerank).status_code == 422
    long_classify = {"input": [LONG], "raw_scores": False}
    assert classifier_server.post("/classify", long_classify).status_code == 422
    # top_n of 0 or below: 422 naming it.
    for top_n in (0, -1):
        body = {"query": QUERY, "documents": DOCS, "raw_scores": False, "top_n": top_n}
        refused = cross_server.post("/rerank", body)
        assert refused.status_code == 422 and refused.json()["error"]["param"] == "top_n"
    # `document` is the text itself, with return_documents.
    shown = cross_server.post(
        "/rerank",
        {"query": QUERY, "documents": DOCS, "raw_scores": False, "return_documents": True},
    ).json()["results"]
    order = [i for i, _ in cross_engine.rerank(QUERY, DOCS)]
    assert [r["document"] for r in shown] == [DOCS[i] for i in order]
    # /classify: a list per input, every label best first.
    data = classifier_server.post("/classify", {"input": DOCS, "raw_scores": False}).json()["data"]
    assert len(data) == len(DOCS)
    for row in data:
        assert [item["label"] for item in row] != [] and len(row) == 2
        scores = [item["score"] for item in row]
        assert scores == sorted(scores, reverse=True) and abs(sum(scores) - 1) <= 1e-6
