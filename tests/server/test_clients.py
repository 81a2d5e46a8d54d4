"""The peers' own Python clients, unchanged, against a live `vecpool serve`: Cohere (v1 and v2),
Hugging Face's `InferenceClient`, LangChain's `OpenAIEmbeddings` and the `openai` client each
get the engine's numbers for their embed and rerank calls."""

from __future__ import annotations

import base64

import cohere
import numpy as np
import openai
import pytest
from huggingface_hub import InferenceClient
from huggingface_hub.errors import HfHubHTTPError
from langchain_openai import OpenAIEmbeddings

import vecpool
from tests.server.conftest import MODEL_NAME, Server
from vecpool.calls import postprocess

TEXTS = ["A man is playing a guitar.", "The cat sleeps on the windowsill.", "Paris in spring"]
QUERY = "what do cats eat"
DOCS = ["the stock market fell sharply", "cats eat fish and mice", "pizza"]
TOLERANCE = 1e-6  # the engine embeds the same texts in a batch of its own: same kernels


def close(got: object, expected: np.ndarray) -> bool:
    return bool(np.abs(np.asarray(got, dtype=np.float32) - expected).max() <= TOLERANCE)


def check_ranked(results: list, expected: list[tuple[int, float]]) -> None:
    assert [r.index for r in results] == [i for i, _ in expected]
    assert close([r.relevance_score for r in results], np.array([s for _, s in expected]))


def test_cohere_v1_embed(server: Server, minilm: vecpool.Engine) -> None:
    client = cohere.Client(base_url=server.url, api_key="unused")
    expected = minilm.embed(TEXTS)
    floats = client.embed(texts=TEXTS, model=MODEL_NAME, input_type="search_document")
    assert floats.response_type == "embeddings_floats"
    assert close(floats.embeddings, expected)
    assert floats.texts == TEXTS and floats.meta.api_version.version == "1"
    typed = client.embed(
        texts=TEXTS,
        model=MODEL_NAME,
        input_type="search_query",
        embedding_types=["float", "int8", "uint8", "binary", "ubinary"],
        truncate="END",
    )
    assert typed.response_type == "embeddings_by_type"
    embeddings = typed.embeddings
    assert close(embeddings.float_, expected)
    served = np.asarray(embeddings.float_, dtype=np.float32)  # quantized from exactly these
    unit = postprocess.unit_ranges(384)
    assert embeddings.int8 == postprocess.quantize(served, "int8", unit).tolist()
    assert embeddings.uint8 == postprocess.quantize(served, "uint8", unit).tolist()
    assert embeddings.binary == postprocess.quantize(served, "binary").tolist()
    assert embeddings.ubinary == postprocess.quantize(served, "ubinary").tolist()
    assert len(embeddings.ubinary[0]) == 384 // 8


def test_cohere_v1_rerank(
    server: Server, minilm: vecpool.Engine, cross_server: Server, cross_engine: vecpool.Engine
) -> None:
    for srv, engine in ((server, minilm), (cross_server, cross_engine)):
        client = cohere.Client(base_url=srv.url, api_key="unused")
        expected = engine.rerank(QUERY, DOCS)
        response = client.rerank(query=QUERY, documents=DOCS, top_n=2)
        check_ranked(response.results, expected[:2])
        documents = [{"text": d, "title": f"doc {i}"} for i, d in enumerate(DOCS)]
        response = client.rerank(query=QUERY, documents=documents, return_documents=True)
        check_ranked(response.results, expected)
        for r in response.results:  # every field of a document comes back as given
            assert r.document.text == DOCS[r.index]
            assert r.document.title == f"doc {r.index}"


def test_cohere_v2_embed_and_rerank(
    server: Server, minilm: vecpool.Engine, cross_server: Server, cross_engine: vecpool.Engine
) -> None:
    client = cohere.ClientV2(base_url=server.url, api_key="unused")
    response = client.embed(
        texts=TEXTS,
        model=MODEL_NAME,
        input_type="search_document",
        embedding_types=["float", "base64"],
        output_dimension=128,
    )
    expected = minilm.embed(TEXTS, dimensions=128)
    assert close(response.embeddings.float_, expected)
    decoded = [np.frombuffer(base64.b64decode(b), "<f4") for b in response.embeddings.base64]
    assert np.array_equal(np.stack(decoded), np.asarray(response.embeddings.float_, np.float32))
    assert response.meta.billed_units.input_tokens == sum(len(minilm.tokenize(t)) for t in TEXTS)
    for srv, engine in ((server, minilm), (cross_server, cross_engine)):
        client = cohere.ClientV2(base_url=srv.url, api_key="unused")
        ranked = client.rerank(
            model=MODEL_NAME if srv is server else "ce", query=QUERY, documents=DOCS
        )
        check_ranked(ranked.results, engine.rerank(QUERY, DOCS))
        cut = client.rerank(
            model=MODEL_NAME if srv is server else "ce",
            query=QUERY,
            documents=DOCS,
            top_n=1,
            max_tokens_per_doc=2,
        )
        check_ranked(cut.results, engine.rerank(QUERY, DOCS, top_n=1, max_tokens_per_doc=2))


def test_cohere_client_errors(server: Server) -> None:
    client = cohere.ClientV2(base_url=server.url, api_key="unused")
    with pytest.raises(cohere.NotFoundError) as missing:
        client.embed(texts=["a"], model="no-such-model", input_type="search_query")
    assert "no-such-model" in missing.value.body["message"]
    with pytest.raises(cohere.BadRequestError) as images:
        client.embed(images=["data:image/png;base64,AAAA"], model=MODEL_NAME, input_type="image")
    assert "texts only" in images.value.body["message"]


def test_huggingface_inference_client(
    server: Server, minilm: vecpool.Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    # CI sets HF_HUB_OFFLINE (nothing may reach a hub), which makes this client refuse every
    # request, a local server's too: lifted for this test, whose only server is ours.
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    client = InferenceClient(base_url=server.url)
    one = client.feature_extraction(TEXTS[0])
    assert one.shape == (1, 384) and one.dtype == np.float32
    assert close(one, minilm.embed(TEXTS[:1]))
    many = client.feature_extraction(TEXTS, normalize=False, truncate=True, dimensions=64)
    expected = minilm.embed(TEXTS, normalize=False, dimensions=64, truncate_prompt_tokens=-1)
    assert many.shape == (3, 64) and close(many, expected)
    with pytest.raises(HfHubHTTPError) as refused:
        client.feature_extraction(TEXTS[0], dimensions=1000)
    assert refused.value.response.status_code == 413
    assert refused.value.response.json()["error_type"] == "validation"


def test_langchain_openai_embeddings(server: Server, minilm: vecpool.Engine) -> None:
    embeddings = OpenAIEmbeddings(
        model=MODEL_NAME,
        base_url=f"{server.url}/v1",
        api_key="unused",  # type: ignore[arg-type]
        check_embedding_ctx_length=False,  # texts as they are, not tiktoken's tokens
        max_retries=0,
    )
    assert close(embeddings.embed_documents(TEXTS), minilm.embed(TEXTS))
    assert close(embeddings.embed_query(TEXTS[1]), minilm.embed(TEXTS[1:2])[0])


def test_openai_client_quantized_and_bytes(server: Server, minilm: vecpool.Engine) -> None:
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    response = client.embeddings.create(
        model=MODEL_NAME,
        input=TEXTS,
        encoding_format="float",
        extra_body={"precision": "int8"},
    )
    served = minilm.embed(TEXTS)
    expected = postprocess.quantize(served, "int8", postprocess.unit_ranges(384))
    assert [d.embedding for d in response.data] == expected.tolist()
