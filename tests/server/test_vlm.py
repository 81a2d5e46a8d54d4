"""Vision-language models over HTTP, through one live `vecpool serve` of two tiny folders: a
GME-style Qwen2-VL embedder ("gme", its folder's chat template) and jina-reranker-m0 ("m0").

vLLM's `messages` with `image_url` parts on `/v1/embeddings` and `/pooling` (rendered by the
folder's chat template, images in place), Jina's `{"image"}` items, Infinity's
`modality: "image"`, Cohere's `images` and `inputs` (text and image parts of one input
together), rerank and score of a text query against text, image and mixed documents (Jina's
`{"image"}`, vLLM's `{"content": [parts]}`), and precomputed rows as vLLM's `image_embeds`
part. Each reaches the input forms of `vecpool.inputs.vision_prompts`:

- the routes and dialects that carry the same inputs give the same numbers, bit for bit (one
  server, one engine path, the same step); inputs that share a step with others are compared
  within the tolerance below (a step's shapes may round a row otherwise);
- those numbers equal the Python API's for the same inputs within 1e-5 of the largest value
  (`assert_rel_close`): the server's engine and the one in this process run the same code on
  the same weights, but with other thread counts, so float32 sums may round apart.

Errors (an image part the template cannot hold, placeholder counts that do not match the
images, precomputed rows of the wrong width, an image to a text-only model) answer 400 naming
the input, and the next request is served.
"""

from __future__ import annotations

import base64
import io
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

import vecpool
from tests.helpers import assert_rel_close
from tests.image_models import encoded
from tests.models.test_jina_vl import save_tiny_jina_vl
from tests.models.test_qwen2_vl import IMAGE, sample_images, save_tiny_qwen2_vl, user
from tests.server.conftest import Server, ServerPool, ServerSpec

RTOL = 1e-5  # of the largest value: the server's engine sums with other thread counts


def _two_models(folder: Path) -> list[str]:
    gme, m0 = folder / "gme", folder / "m0"
    save_tiny_qwen2_vl(gme, qwen2_5=False)
    save_tiny_jina_vl(m0)
    return [
        *(str(gme), str(m0), "--served-model-name", "gme", "--served-model-name", "m0"),
        "--enable-prompt-embeds",
    ]


SERVERS = {"vlm_server": ServerSpec(_two_models)}


@pytest.fixture(scope="module")
def vlm_server(server_pool: ServerPool, request: pytest.FixtureRequest) -> Iterator[Server]:
    srv = server_pool.take(request, "vlm_server")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def folder(vlm_server: Server, server_pool: ServerPool, request: pytest.FixtureRequest) -> Path:
    """The folder the server's models were built in (its server started)."""
    return server_pool.folder(request, "vlm_server")


@pytest.fixture(scope="module")
def gme(folder: Path) -> vecpool.Engine:
    return vecpool.Engine(folder / "gme", device="cpu", enable_prompt_embeds=True)


@pytest.fixture(scope="module")
def m0(folder: Path) -> vecpool.Engine:
    return vecpool.Engine(folder / "m0", device="cpu")


def data_uri(seed: int, size: tuple[int, int]) -> str:
    (image,) = sample_images([size], seed=seed)
    return f"data:image/png;base64,{base64.b64encode(encoded(image)).decode()}"


A, B = data_uri(1, (40, 27)), data_uri(2, (21, 50))


def ok(response: httpx.Response) -> dict[str, Any]:
    assert response.status_code == 200, response.text
    body: dict[str, Any] = response.json()
    return body


def vectors(body: dict[str, Any], key: str = "embedding") -> np.ndarray:
    return np.asarray([d[key] for d in body["data"]], dtype=np.float32)


def refused(response: httpx.Response, *words: str) -> str:
    assert response.status_code == 400, response.text
    text = response.text
    for word in words:
        assert word in text, text
    return text


def image_part(url: str) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url}}


def text_part(text: str) -> dict[str, Any]:
    return {"type": "text", "text": text}


# ---- embedders: messages and the other dialects ------------------------------------------


def test_messages_with_images_on_embeddings_and_pooling(
    vlm_server: Server, gme: vecpool.Engine
) -> None:
    content = [text_part("a red cat"), image_part(A), text_part("on the house")]
    messages = [{"role": "user", "content": content}]
    body = {"model": "gme", "messages": messages}
    plain = vectors(ok(vlm_server.post("/v1/embeddings", body)))
    pooled = vectors(ok(vlm_server.post("/pooling", body)), "data")
    np.testing.assert_array_equal(plain, pooled)  # one engine path
    # The folder's template writes the conversation; without a generation prompt (vLLM's
    # default for pooling) it is the prompt form with the text written.
    written = user(f"a red cat{IMAGE}on the house").removesuffix("<|im_start|>assistant\n")
    assert_rel_close(plain, gme.embed([{"prompt": written, "image": A}]), RTOL)
    # With the generation prompt: the Python API's list of parts (one user message).
    with_prompt = {**body, "add_generation_prompt": True}
    expected = gme.embed([[text_part("a red cat"), image_part(A), text_part("on the house")]])
    assert_rel_close(vectors(ok(vlm_server.post("/v1/embeddings", with_prompt))), expected, RTOL)
    # Several turns and images, a system message: the template's rendering, images in order.
    turns = [
        {"role": "system", "content": "You are a dog."},
        {"role": "user", "content": [image_part(B), text_part("a photo")]},
        {"role": "assistant", "content": "the cat"},
        {"role": "user", "content": [image_part(A)]},
    ]
    got = vectors(ok(vlm_server.post("/v1/embeddings", {"model": "gme", "messages": turns})))
    prompt = (
        "<|im_start|>system\nYou are a dog.<|im_end|>\n"
        f"<|im_start|>user\n{IMAGE}a photo<|im_end|>\n<|im_start|>assistant\nthe cat<|im_end|>\n"
        f"<|im_start|>user\n{IMAGE}<|im_end|>\n"
    )
    assert_rel_close(got, gme.embed([{"prompt": prompt, "image": [B, A]}]), RTOL)


def test_images_in_every_embedding_dialect_are_one_engine_path(
    vlm_server: Server, gme: vecpool.Engine
) -> None:
    jina = ok(
        vlm_server.post("/v1/embeddings", {"model": "gme", "input": [{"image": A}, {"image": B}]})
    )
    infinity = ok(
        vlm_server.post("/embeddings", {"model": "gme", "input": [A, B], "modality": "image"})
    )
    cohere = ok(vlm_server.post("/v2/embed", {"model": "gme", "images": [A, B]}))
    np.testing.assert_array_equal(vectors(jina), vectors(infinity))
    np.testing.assert_array_equal(
        vectors(jina), np.asarray(cohere["embeddings"]["float"], np.float32)
    )
    assert_rel_close(vectors(jina), gme.embed([A, B]), RTOL)
    # Cohere's inputs: an input of one image part is the image (the same step: the same
    # bits); text and image parts of one input are read together, as the Python API's list
    # of parts.
    one_each = [{"content": [image_part(A)]}, {"content": [image_part(B)]}]
    got = ok(vlm_server.post("/v2/embed", {"model": "gme", "inputs": one_each}))
    np.testing.assert_array_equal(np.asarray(got["embeddings"]["float"], np.float32), vectors(jina))
    mixed = [{"content": [text_part("a cat"), image_part(A)]}]
    got = ok(vlm_server.post("/v2/embed", {"model": "gme", "inputs": mixed}))
    expected = gme.embed([[text_part("a cat"), image_part(A)]])
    assert_rel_close(np.asarray(got["embeddings"]["float"], np.float32), expected, RTOL)


def test_precomputed_rows_as_an_image_embeds_part(vlm_server: Server, gme: vecpool.Engine) -> None:
    """vLLM's `image_embeds` part, `{"image_embeds": "<base64 .npy>", "image_grid_thw":
    [1, rows, columns]}`: rows from `Engine.image_rows` give what the image gives (within the
    tolerance: this process's tower computed them)."""
    (rows,) = gme.image_rows(A)
    buffer = io.BytesIO()
    np.save(buffer, rows["image_embeds"].numpy())
    embeds: dict[str, Any] = {
        "image_embeds": base64.b64encode(buffer.getvalue()).decode(),
        "image_grid_thw": rows["image_grid_thw"],
    }
    part = {"type": "image_embeds", "image_embeds": embeds}
    by_rows = {
        "model": "gme",
        "messages": [{"role": "user", "content": [text_part("a cat"), part]}],
    }
    by_image = {
        "model": "gme",
        "messages": [{"role": "user", "content": [text_part("a cat"), image_part(A)]}],
    }
    assert_rel_close(
        vectors(ok(vlm_server.post("/v1/embeddings", by_rows))),
        vectors(ok(vlm_server.post("/v1/embeddings", by_image))),
        RTOL,
    )
    buffer = io.BytesIO()
    np.save(buffer, rows["image_embeds"][:, :31].numpy())
    embeds["image_embeds"] = base64.b64encode(buffer.getvalue()).decode()
    refused(vlm_server.post("/v1/embeddings", by_rows), "messages", "width 31", "hidden size 32")


# ---- the multimodal reranker ----------------------------------------------------------------


def test_rerank_and_score_with_image_documents(vlm_server: Server, m0: vecpool.Engine) -> None:
    query = "a red cat"
    documents = [
        "the dog on the house",
        {"image": A},  # Jina's
        {"content": [image_part(B)]},  # vLLM's
        {"content": [text_part("house"), image_part(A)]},  # text and image together
    ]
    ranked = ok(
        vlm_server.post("/v1/rerank", {"model": "m0", "query": query, "documents": documents})
    )
    scores = np.zeros(len(documents), dtype=np.float32)
    for result in ranked["results"]:
        scores[result["index"]] = result["relevance_score"]
    expected = m0.score(
        query,
        ["the dog on the house", {"image": A}, {"image": B}, [text_part("house"), image_part(A)]],
    )
    assert_rel_close(scores, expected, RTOL)
    assert [r["index"] for r in ranked["results"]] == list(np.argsort(-scores, kind="stable"))
    # vLLM's /score with content items (Jina's image document as a content item): the same
    # pairs in the same step, the same numbers.
    seconds = [documents[0], {"content": [image_part(A)]}, *documents[2:]]
    scored = ok(vlm_server.post("/score", {"model": "m0", "text_1": query, "text_2": seconds}))
    got = np.asarray([d["score"] for d in scored["data"]], np.float32)
    np.testing.assert_array_equal(got, scores)


# ---- errors ---------------------------------------------------------------------------------


def test_bad_inputs_answer_400_naming_the_input(
    vlm_server: Server, server: Server, gme: vecpool.Engine
) -> None:
    audio = {"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}
    refused(
        vlm_server.post(
            "/v1/embeddings", {"model": "gme", "messages": [{"role": "user", "content": [audio]}]}
        ),
        "messages",
        "content part 0",
    )
    # A placeholder written in the text besides the image part's: two for one image.
    two = [{"role": "user", "content": [text_part(f"a cat {IMAGE}"), image_part(A)]}]
    refused(
        vlm_server.post("/v1/embeddings", {"model": "gme", "messages": two}),
        "messages",
        "2 image placeholders",
        "1 image",
    )
    refused(
        vlm_server.post(
            "/v1/embeddings",
            {"model": "gme", "input": ["a cat", {"image": "data:image/png;base64,AAAA"}]},
        ),
        "input[1]",
    )
    refused(
        vlm_server.post(
            "/v1/rerank", {"model": "m0", "query": "a cat", "documents": ["x", {"image": "nope"}]}
        ),
        "documents",
    )
    # An image to a text-only model (the session's default server: MiniLM).
    refused(server.post("/v1/embeddings", {"input": ["a cat", {"image": A}]}), "input[1]", "image")
    # Bad requests beside good ones, at once: each bad one alone is refused, the others served.
    good = {"model": "gme", "input": [{"image": A}, "a red cat"]}
    bad = {"model": "gme", "messages": two}
    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(lambda b: vlm_server.post("/v1/embeddings", b), [good, bad] * 2))
    for answer in answers[1::2]:
        refused(answer, "2 image placeholders")
    # (Each within the tolerance: the two may share a step, whose tower runs both images in
    # other matrix shapes.)
    for answer in answers[0::2]:
        assert_rel_close(vectors(ok(answer)), gme.embed([A, "a red cat"]), RTOL)


def test_the_engine_message_carries_a_prompts_images(gme: vecpool.Engine) -> None:
    """The API process's message to the engine process holds a vision-language prompt's
    images (patch rows, or precomputed rows) and its M-RoPE positions, exactly."""
    from vecpool.calls import PromptRequest
    from vecpool.server import wire
    from vecpool.tasks import PoolingParams

    (rows,) = gme.image_rows(B)
    prompts = gme.inputs.process(
        [{"text": "a cat", "image": [A, rows]}, "the dog"], _text_options()
    )
    requests = [PromptRequest(i, p, PoolingParams(task="embed")) for i, p in enumerate(prompts)]
    message = wire.to_engine.decode(wire.encoder.encode(wire.submit(7, requests)))
    assert isinstance(message, wire.Submit)
    for sent, got in zip(requests, wire.prompt_requests(message), strict=True):
        a, b = sent.prompt, got.prompt
        assert len(a.images) == len(b.images)
        for x, y in zip(a.images, b.images, strict=True):
            assert (x.start, x.num_tokens, x.grid) == (y.start, y.num_tokens, y.grid)
            for u, v in ((x.pixels, y.pixels), (x.rows, y.rows)):
                assert (u is None) == (v is None)
            if x.pixels is not None and y.pixels is not None:
                np.testing.assert_array_equal(x.pixels.patches, y.pixels.patches)
            if x.rows is not None:
                np.testing.assert_array_equal(x.rows, y.rows)
        if a.mrope_positions is None:
            assert b.mrope_positions is None
        else:
            np.testing.assert_array_equal(a.mrope_positions, b.mrope_positions)
        np.testing.assert_array_equal(a.token_ids, b.token_ids)


def _text_options() -> Any:
    from vecpool.inputs.prompts import TextOptions

    return TextOptions()
