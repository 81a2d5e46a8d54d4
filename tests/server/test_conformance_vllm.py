"""vLLM's documented behaviour of its pooling routes, one expectation a test.

Sources (vLLM's own documentation and tests): the "OpenAI-Compatible Server" guide (Embeddings,
Pooling, Classification, Score and Re-rank APIs, chat-format embedding input), the "Pooling
Models" guide (Matryoshka embeddings), the entrypoint tests `test_embedding.py`,
`test_classification.py`, `test_rerank.py`, `test_score.py`, `test_truncation.py`, their
successors under `tests/entrypoints/pooling/` (`classify/test_online.py`'s
`test_pooling_not_supported`, `pooling/test_online.py`'s `test_params_not_supported` and its
`--chat-template` server, `scoring/test_cross_encoder_online.py`'s max-model-len test), its error
bodies (`ErrorResponse`, `create_error_response`: `type` BadRequestError, `code` the status), and
its Cohere route's protocol (`pooling/embed/cohere/protocol.py`).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import transformers

import vecpool
from tests.server.conformance import MODEL, ask, error_message
from tests.server.conftest import CHAT_TEMPLATE

# The guide's examples.
TEXT = "The food was delicious and the waiter..."
QUERY = "What is the capital of France?"
DOCS = ["The capital of Brazil is Brasilia.", "The capital of France is Paris."]
MESSAGES = [
    {"role": "system", "content": "Represent the question for retrieval."},
    {"role": "user", "content": [{"type": "text", "text": QUERY}]},
]
LONG = "word " * 300  # over the tiny models' 128 tokens


def vector(response: object) -> np.ndarray:
    assert response.status_code == 200, response.text  # type: ignore[attr-defined]
    data = response.json()["data"]  # type: ignore[attr-defined]
    return np.asarray([d["embedding"] for d in data], dtype=np.float32)


# ---- embeddings ------------------------------------------------------------------------


def test_vllm_chat_messages_are_rendered_by_the_model_chat_template(
    chat_engine: vecpool.Engine, chat_matryoshka_dir: Path
) -> None:
    # The guide: `messages` on /v1/embeddings, rendered by the tokenizer's chat template,
    # tokenized without adding special tokens (the template writes them).
    # vLLM hands a template that reads `content` as a string the text parts joined by "\n".
    tokenizer = transformers.AutoTokenizer.from_pretrained(chat_matryoshka_dir)
    flat = [MESSAGES[0], {"role": "user", "content": QUERY}]
    text = tokenizer.apply_chat_template(flat, tokenize=False)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    expected = chat_engine.embed([ids])
    got = vector(ask(chat_engine, "/v1/embeddings", {"model": MODEL, "messages": MESSAGES}))
    # The same ids through the same engine: equal but for the JSON round trip of float32.
    assert got.shape == expected.shape
    assert np.abs(got - expected).max() <= 1e-6
    # /pooling and /classify take them too (the pooling route here).
    pooled = ask(chat_engine, "/pooling", {"messages": MESSAGES, "task": "embed"})
    assert pooled.status_code == 200, pooled.text
    assert np.abs(np.asarray(pooled.json()["data"][0]["data"]) - expected[0]).max() <= 1e-6


def test_vllm_chat_messages_on_a_model_without_a_template_are_refused(
    tiny_embed_engine: vecpool.Engine,
) -> None:
    # transformers' (and so vLLM's) refusal: no default chat template since v4.44.
    response = ask(tiny_embed_engine, "/v1/embeddings", {"messages": MESSAGES})
    assert response.status_code == 400
    assert "default chat template is no longer allowed" in error_message(response)


def test_vllm_chat_template_in_the_request_is_refused_untrusted(
    chat_engine: vecpool.Engine,
) -> None:
    # vLLM refuses a request's chat_template unless --trust-request-chat-template.
    body = {"messages": MESSAGES, "chat_template": "{{ messages }}"}
    response = ask(chat_engine, "/v1/embeddings", body)
    assert response.status_code == 400
    assert "untrusted chat template" in error_message(response)


def test_vllm_add_special_tokens_false_embeds_the_text_tokens_only(
    tiny_embed_engine: vecpool.Engine, tiny_embedder: Path
) -> None:
    tokenizer = transformers.AutoTokenizer.from_pretrained(tiny_embedder)
    ids = tokenizer(TEXT, add_special_tokens=False)["input_ids"]
    for path, key in (("/v1/embeddings", "embedding"), ("/pooling", "data")):
        response = ask(tiny_embed_engine, path, {"input": TEXT, "add_special_tokens": False})
        assert response.status_code == 200, response.text
        got = np.asarray(response.json()["data"][0][key], dtype=np.float32)
        assert np.abs(got - tiny_embed_engine.embed([ids])[0]).max() <= 1e-6
    usage = ask(tiny_embed_engine, "/v1/embeddings", {"input": TEXT, "add_special_tokens": False})
    assert usage.json()["usage"]["prompt_tokens"] == len(ids)


def test_vllm_dimensions_on_a_model_without_matryoshka_is_refused(
    tiny_embed_engine: vecpool.Engine,
) -> None:
    # The Pooling Models guide: 400, 'Model "..." does not support matryoshka representation,
    # changing output dimensions will lead to poor results.'
    response = ask(tiny_embed_engine, "/v1/embeddings", {"input": TEXT, "dimensions": 8})
    assert response.status_code == 400
    assert "does not support matryoshka representation" in error_message(response)
    assert response.json()["error"]["param"] == "dimensions"


def test_vllm_dimensions_on_a_matryoshka_model_cut_the_vector(chat_engine: vecpool.Engine) -> None:
    # config.json's matryoshka_dimensions: those sizes and no others.
    got = vector(ask(chat_engine, "/v1/embeddings", {"input": TEXT, "dimensions": 8}))
    assert np.abs(got - chat_engine.embed([TEXT], dimensions=8)).max() <= 1e-6
    refused = ask(chat_engine, "/v1/embeddings", {"input": TEXT, "dimensions": 12})
    assert refused.status_code == 400 and "matryoshka" in error_message(refused)


def test_vllm_truncate_prompt_tokens_above_the_limit_is_refused(
    tiny_embed_engine: vecpool.Engine, cross_engine: vecpool.Engine
) -> None:
    # test_truncation.py: 400 "truncate_prompt_tokens value ... is greater than max_model_len";
    # the score tests since: "Please request a smaller truncation size.".
    for engine, path, body in (
        (tiny_embed_engine, "/v1/embeddings", {"input": TEXT}),
        (cross_engine, "/rerank", {"query": QUERY, "documents": DOCS}),
        (cross_engine, "/score", {"text_1": QUERY, "text_2": DOCS}),
    ):
        response = ask(engine, path, {**body, "truncate_prompt_tokens": 100000})
        assert response.status_code == 400, (path, response.text)
        assert "is greater than max_model_len" in error_message(response)
        assert "Please request a smaller truncation size." in error_message(response)


# ---- score and rerank ------------------------------------------------------------------


def test_vllm_rerank_input_too_long_is_a_400_asking_to_reduce_it(
    cross_engine: vecpool.Engine,
) -> None:
    # The rerank and score tests: status 400 and "Please reduce the length of the input
    # prompt" in the body (vLLM's renderer's words; "... of the input." before it).
    response = ask(cross_engine, "/rerank", {"query": QUERY, "documents": [LONG, DOCS[0]]})
    assert response.status_code == 400
    assert "Please reduce the length of the input prompt" in response.text


def test_vllm_score_input_too_long_is_a_400_asking_to_reduce_it(
    cross_engine: vecpool.Engine,
) -> None:
    response = ask(cross_engine, "/score", {"queries": LONG, "documents": DOCS})
    assert response.status_code == 400
    assert "Please reduce the length of the input prompt" in response.text


def test_vllm_score_example(cross_engine: vecpool.Engine) -> None:
    # The guide's Score API example and its answer's shape.
    response = ask(cross_engine, "/score", {"model": MODEL, "text_1": QUERY, "text_2": DOCS})
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["object"] == "list" and body["model"] == MODEL
    assert [(d["index"], d["object"]) for d in body["data"]] == [(0, "score"), (1, "score")]
    expected = cross_engine.score(QUERY, DOCS)
    assert np.abs(np.array([d["score"] for d in body["data"]]) - expected).max() <= 1e-6
    assert body["usage"]["prompt_tokens"] == body["usage"]["total_tokens"] > 0


def test_vllm_rerank_example_top_n_zero_is_every_document(cross_engine: vecpool.Engine) -> None:
    # RerankRequest.top_n defaults to 0: every document, best first, each with its text.
    response = ask(cross_engine, "/rerank", {"query": QUERY, "documents": DOCS, "top_n": 0})
    assert response.status_code == 200, response.text
    results = response.json()["results"]
    expected = cross_engine.rerank(QUERY, DOCS)
    assert [r["index"] for r in results] == [i for i, _ in expected]
    assert [r["document"]["text"] for r in results] == [DOCS[i] for i, _ in expected]
    assert response.json()["usage"]["total_tokens"] > 0


def test_vllm_score_and_rerank_on_a_plain_classifier_are_not_found(
    classifier_engine: vecpool.Engine,
) -> None:
    # vLLM serves /score and /rerank only for a model that scores pairs: not found elsewhere.
    for path, body in (
        ("/score", {"text_1": QUERY, "text_2": DOCS}),
        ("/rerank", {"query": QUERY, "documents": DOCS}),
        ("/v1/rerank", {"query": QUERY, "documents": DOCS}),
    ):
        response = ask(classifier_engine, path, body)
        assert response.status_code == 404, (path, response.text)


# ---- pooling and classify --------------------------------------------------------------


def test_vllm_pooling_with_a_task_the_model_lacks(tiny_embed_engine: vecpool.Engine) -> None:
    # pooling/serving.py: 400 "Unsupported task: ... Supported tasks: ...".
    response = ask(tiny_embed_engine, "/pooling", {"input": TEXT, "task": "classify"})
    assert response.status_code == 400
    message = error_message(response)
    assert "Unsupported task: 'classify'" in message and "Supported tasks" in message


@pytest.mark.xfail(
    strict=True,
    reason="choice, as vLLM's pooling-task switch since: a sequence classifier runs its head "
    "over every token only once asked (--task token_classify); earlier vLLM did by default",
)
def test_vllm_cross_encoder_pooling_token_classify(cross_engine: vecpool.Engine) -> None:
    response = ask(cross_engine, "/pooling", {"input": TEXT, "task": "token_classify"})
    assert response.status_code == 200, response.text


@pytest.mark.parametrize("task", ["embed", "token_embed", "token_classify"])
def test_vllm_pooling_tasks_a_classifier_is_not_made_for(
    classifier_engine: vecpool.Engine, task: str
) -> None:
    # classify/test_online.py, test_pooling_not_supported: type BadRequestError; embed and
    # token_embed "Unsupported task: ...", token_classify "Try switching the model's
    # pooling_task via ...".
    response = ask(classifier_engine, "/pooling", {"input": TEXT, "task": task})
    assert response.json()["error"]["type"] == "BadRequestError"
    assert response.json()["error"]["code"] == 400 == response.status_code
    if task == "token_classify":
        assert error_message(response).startswith("Try switching the model's pooling_task via")
    else:
        assert error_message(response).startswith(f"Unsupported task: {task!r}")


def test_vllm_sequence_classifier_token_classify_once_switched(
    cross_encoder_dir: Path, cross_engine: vecpool.Engine
) -> None:
    # Switched (vLLM: the pooler config's task; vecpool: --task token_classify), the
    # classifier's head over every token: [num_tokens, num_labels].
    engine = vecpool.Engine(cross_encoder_dir, device="cpu", tasks=["token_classify"])
    response = ask(engine, "/pooling", {"input": TEXT, "task": "token_classify"})
    assert response.status_code == 200, response.text
    rows = np.asarray(response.json()["data"][0]["data"])
    assert rows.shape == (len(cross_engine.tokenize(TEXT)), 1)
    expected = engine.encode([TEXT], task="token_classify")[0]
    assert np.abs(rows - expected).max() <= 1e-6


@pytest.mark.parametrize("field", ["encoding_format", "embed_dtype", "endianness"])
def test_vllm_bad_values_name_pydantics_error(
    tiny_embed_engine: vecpool.Engine, field: str
) -> None:
    # pooling/test_online.py, test_params_not_supported: 400, "literal_error" and the value in
    # the message.
    body = {"input": TEXT, "encoding_format": "base64", field: f"bad_{field}"}
    response = ask(tiny_embed_engine, "/pooling", body)
    assert response.status_code == 400
    assert "literal_error" in error_message(response)
    assert f"bad_{field}" in error_message(response)


def test_vllm_chat_template_flag_serves_a_folder_without_one(tiny_embedder: Path) -> None:
    # pooling/test_online.py serves a model with `--chat-template` and renders messages by it.
    engine = vecpool.Engine(tiny_embedder, device="cpu", chat_template=CHAT_TEMPLATE)
    tokenizer = transformers.AutoTokenizer.from_pretrained(tiny_embedder)
    flat = [MESSAGES[0], {"role": "user", "content": QUERY}]
    text = tokenizer.apply_chat_template(flat, chat_template=CHAT_TEMPLATE, tokenize=False)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    got = vector(ask(engine, "/v1/embeddings", {"messages": MESSAGES}))
    assert np.abs(got - engine.embed([ids])).max() <= 1e-6


def test_vllm_classify_example(classifier_engine: vecpool.Engine) -> None:
    # The guide's Classification API answer: label, probs, num_classes per input.
    texts = ["Loved the new café—coffee was great.", "This update broke everything."]
    response = ask(classifier_engine, "/classify", {"model": MODEL, "input": texts})
    assert response.status_code == 200, response.text
    data = response.json()["data"]
    expected = classifier_engine.classify(texts)
    assert [d["index"] for d in data] == [0, 1]
    assert all(d["num_classes"] == 2 for d in data)
    assert np.abs(np.array([d["probs"] for d in data]) - expected).max() <= 1e-6
    labels = ["negative", "positive"]
    assert [d["label"] for d in data] == [labels[int(np.argmax(p))] for p in expected]


def test_vllm_classify_add_special_tokens(
    classifier_engine: vecpool.Engine, classifier_dir: Path
) -> None:
    tokenizer = transformers.AutoTokenizer.from_pretrained(classifier_dir)
    ids = tokenizer(TEXT, add_special_tokens=False)["input_ids"]
    response = ask(classifier_engine, "/classify", {"input": [TEXT], "add_special_tokens": False})
    assert response.status_code == 200, response.text
    got = np.array(response.json()["data"][0]["probs"])
    assert np.abs(got - classifier_engine.classify([ids])[0]).max() <= 1e-6


# ---- vLLM's Cohere route ---------------------------------------------------------------


def test_vllm_cohere_v2_embed_response_fields(tiny_embed_engine: vecpool.Engine) -> None:
    # CohereEmbedResponse: id, embeddings by type, texts, meta (api_version, tokens).
    body = {"model": MODEL, "texts": [TEXT], "embedding_types": ["float"]}
    response = ask(tiny_embed_engine, "/v2/embed", body)
    assert response.status_code == 200, response.text
    got = response.json()
    assert got["texts"] == [TEXT]
    assert got["meta"]["api_version"] == {"version": "2"}
    tokens = len(tiny_embed_engine.tokenize(TEXT))
    assert got["meta"]["tokens"] == {"input_tokens": tokens}
    expected = tiny_embed_engine.embed([TEXT])
    assert np.abs(np.asarray(got["embeddings"]["float"]) - expected).max() <= 1e-6


def test_vllm_sagemaker_invocations_take_messages(chat_engine: vecpool.Engine) -> None:
    # vLLM's /invocations serves a body by its shape: messages are an embedding request here.
    direct = vector(ask(chat_engine, "/v1/embeddings", {"messages": MESSAGES}))
    routed = vector(ask(chat_engine, "/invocations", {"messages": MESSAGES}))
    assert np.array_equal(routed, direct)
