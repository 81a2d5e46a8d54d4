"""Images over HTTP, in each peer's own request shape, through a live `vecpool serve` of a tiny
CLIP folder: OpenAI / Jina `input` items (`{"image": ...}`, `{"text": ...}`, `data:image/`
strings), vLLM's `messages` (one text or one `image_url` part) on `/v1/embeddings` and
`/pooling`, Infinity's `modality: "image"`, Cohere's `images` and `inputs` (v1 and v2), rerank
and score with image documents (Jina's `{"image"}`, vLLM's `{"content": [parts]}`); and the
openai and cohere Python clients that can send images.

Every vector is compared with transformers' `get_text_features` / `get_image_features` on the
same weights and the folder's own image processor, normalized where the route normalizes,
within 1e-5 of the largest value (`assert_rel_close`): fp32 on the CPU, the towers compute
transformers' arithmetic in other kernel shapes (flat batches, a matrix product for the patch
convolution), so equal within rounding, not to the bit. Scores are cosines of those vectors,
within 1e-5.

Images come as data: URIs, bare base64, files under `--allowed-local-media-path` and URLs of
a local HTTP server in a thread (`ImageHost`, whose host is allowed with
`--allowed-media-domains`). One server for the module.
"""

from __future__ import annotations

import base64
import http.server
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import cohere
import httpx
import numpy as np
import openai
import pytest
import transformers
from openai.types import CreateEmbeddingResponse
from PIL import Image

from tests.helpers import assert_rel_close
from tests.image_models import (
    CLIP,
    encoded,
    hf_image_features,
    hf_text_features,
    sample_images,
    save_tiny_dual_encoder,
)
from tests.server.conftest import Server, ServerPool, ServerSpec

TEXTS = ["a photo of a cat", "two red cars on the sea", "bird"]
RTOL = 1e-5  # of the largest value: fp32, other kernel shapes than transformers'


# ---- a local image host --------------------------------------------------------------------

Route = Callable[[http.server.BaseHTTPRequestHandler], None]


class ImageHost:
    """An HTTP server on 127.0.0.1 in a thread, answering each path with a route of the test's
    (`serve(path, route)`); `url(path)` is its URL under a host name the server under test
    allows."""

    def __init__(self) -> None:
        self.routes: dict[str, Route] = {}
        self.hits: dict[str, int] = {}
        host = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                path = self.path.partition("?")[0]
                host.hits[path] = host.hits.get(path, 0) + 1
                route = host.routes.get(path)
                if route is None:
                    self.send_error(404)
                else:
                    route(self)

            def log_message(self, *args: Any) -> None:  # quiet
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def url(self, path: str, host: str = "127.0.0.1") -> str:
        return f"http://{host}:{self.port}{path}"

    def serve(self, path: str, route: Route) -> str:
        self.routes[path] = route
        return self.url(path)

    def serve_bytes(self, path: str, data: bytes, content_type: str = "image/png") -> str:
        def route(handler: http.server.BaseHTTPRequestHandler) -> None:
            handler.send_response(200)
            handler.send_header("Content-Type", content_type)
            handler.send_header("Content-Length", str(len(data)))
            handler.end_headers()
            handler.wfile.write(data)

        return self.serve(path, route)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def data_uri(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


def clip_args(model: Path, media: Path, *extra: str) -> list[str]:
    """`vecpool serve`'s arguments for the CLIP folder `model`: local files under `media`, URLs
    to this machine."""
    return [
        *(str(model), "--served-model-name", "clip"),
        *("--allowed-local-media-path", str(media)),
        *("--allowed-media-domains", "127.0.0.1", "localhost"),
        *extra,
    ]


def reference_clip(model: Path) -> Any:
    """transformers' model on the weights of the folder `save_tiny_dual_encoder` wrote (fp32,
    eager attention, as it returns it)."""
    return transformers.CLIPModel.from_pretrained(str(model), attn_implementation="eager").eval()


# ---- fixtures -------------------------------------------------------------------------------


@dataclass
class Clip:
    server: Server
    host: ImageHost
    folder: Path
    images: list[Image.Image]
    pngs: list[bytes]
    texts: np.ndarray  # [3, dim] normalized text features of TEXTS
    pictures: np.ndarray  # [3, dim] normalized image features of `images`
    raw_texts: np.ndarray  # the same, unnormalized
    raw_pictures: np.ndarray


def unit(rows: np.ndarray) -> np.ndarray:
    return rows / np.linalg.norm(rows, axis=1, keepdims=True)


def _clip_server_args(folder: Path) -> list[str]:
    """The module's server: a tiny CLIP folder (`folder/model`), the sample pictures as files
    under `folder/media`."""
    save_tiny_dual_encoder(folder / "model", CLIP)
    (folder / "media").mkdir()
    for i, image in enumerate(sample_images(3)):
        (folder / "media" / f"picture{i}.png").write_bytes(encoded(image, "PNG"))
    return clip_args(folder / "model", folder / "media")


SERVERS = {"clip": ServerSpec(_clip_server_args, log_level="info")}


@pytest.fixture(scope="module")
def clip(server_pool: ServerPool, request: pytest.FixtureRequest) -> Iterator[Clip]:
    server = server_pool.take(request, "clip")
    folder = server_pool.folder(request, "clip") / "model"
    hf = reference_clip(folder)
    images = sample_images(3)
    pngs = [encoded(image, "PNG") for image in images]
    host = ImageHost()
    for i, png in enumerate(pngs):
        host.serve_bytes(f"/picture{i}.png", png)
    raw_texts = hf_text_features(hf, folder, TEXTS)
    raw_pictures = hf_image_features(hf, folder, images)
    yield Clip(
        server,
        host,
        folder,
        images,
        pngs,
        unit(raw_texts),
        unit(raw_pictures),
        raw_texts,
        raw_pictures,
    )
    server.stop()
    host.close()


def ok(response: httpx.Response) -> Any:
    assert response.status_code == 200, response.text[:500]
    return response.json()


def vectors(body: Any, key: str = "embedding") -> np.ndarray:
    return np.asarray([item[key] for item in body["data"]], dtype=np.float32)


def image_part(url: str) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url}}


def text_part(text: str) -> dict[str, str]:
    return {"type": "text", "text": text}


# ---- embeddings -----------------------------------------------------------------------------


def test_openai_and_jina_inputs_mix_texts_and_images(clip: Clip) -> None:
    """`input` mixing texts with every image form: Jina's `{"image"}` (URL, data: URI, bare
    base64, a file under the allowed folder) and `{"text"}`, and `data:image/` strings."""
    png = clip.pngs
    body = {
        "input": [
            TEXTS[0],
            {"image": clip.host.url("/picture0.png")},
            {"text": TEXTS[1]},
            data_uri(png[1]),
            {"image": base64.b64encode(png[2]).decode()},
            {"image": data_uri(png[0])},
            {"image": "picture1.png"},
            {"image": clip.host.url("/picture2.png", host="localhost")},
            TEXTS[2],
        ]
    }
    got = vectors(ok(clip.server.post("/v1/embeddings", body)))
    assert_rel_close(got[[0, 2, 8]], clip.texts, RTOL)
    assert_rel_close(got[[1, 3, 4, 5, 6, 7]], clip.pictures[[0, 1, 2, 0, 1, 2]], RTOL)
    raw = {"input": [{"image": data_uri(png[0])}, TEXTS[0]], "normalize": False}
    got = vectors(ok(clip.server.post("/v1/embeddings", raw)))
    assert_rel_close(got, np.stack([clip.raw_pictures[0], clip.raw_texts[0]]), RTOL)


@pytest.mark.parametrize("path", ["/v1/embeddings", "/pooling"])
def test_vllm_messages_one_text_or_one_image(clip: Clip, path: str) -> None:
    """vLLM's chat form for CLIP: one message, one part; an image part is the image, a text
    part (or a string) the text, tokenized as `input` texts are."""
    key = "embedding" if path == "/v1/embeddings" else "data"
    forms: list[tuple[Any, np.ndarray]] = [
        ([image_part(data_uri(clip.pngs[0]))], clip.pictures[0]),
        ([image_part(clip.host.url("/picture1.png"))], clip.pictures[1]),
        ([text_part(TEXTS[0])], clip.texts[0]),
        (TEXTS[1], clip.texts[1]),
    ]
    for content, expected in forms:
        body = {"messages": [{"role": "user", "content": content}]}
        got = vectors(ok(clip.server.post(path, body)), key)
        assert got.shape == (1, expected.shape[0])
        assert_rel_close(got[0], expected, RTOL)


def test_infinity_image_modality(clip: Clip) -> None:
    """Infinity's `/embeddings` with `modality: "image"`: `input` a list of URLs and data:
    URIs; `/models` says the model embeds images."""
    body = {
        "model": "clip",
        "modality": "image",
        "input": [clip.host.url("/picture2.png"), data_uri(clip.pngs[0])],
    }
    got = vectors(ok(clip.server.post("/embeddings", body)))
    assert_rel_close(got, clip.pictures[[2, 0]], RTOL)
    models = ok(clip.server.client.get("/models"))["data"]
    assert models[0]["capabilities"] == ["embed", "image_embed"]


@pytest.mark.parametrize("version", [1, 2])
def test_cohere_images_and_inputs(clip: Clip, version: int) -> None:
    path = f"/v{version}/embed"
    images = {"images": [data_uri(png) for png in clip.pngs], "input_type": "image"}
    answer = ok(clip.server.post(path, {**images, "embedding_types": ["float"]}))
    assert answer["texts"] == [] and answer["meta"]["billed_units"]["images"] == 3
    got = np.asarray(answer["embeddings"]["float"], np.float32)
    assert_rel_close(got, clip.pictures, RTOL)
    if version == 1:  # without embedding_types: Cohere v1's list of float vectors
        got = np.asarray(ok(clip.server.post(path, images))["embeddings"], np.float32)
        assert_rel_close(got, clip.pictures, RTOL)
    inputs = [
        {"content": [text_part(TEXTS[2])]},
        {"content": [image_part(data_uri(clip.pngs[1]))]},
        {"content": [image_part(clip.host.url("/picture0.png"))]},
    ]
    body = {"inputs": inputs, "input_type": "search_query", "embedding_types": ["float"]}
    got = np.asarray(ok(clip.server.post(path, body))["embeddings"]["float"], np.float32)
    assert_rel_close(got, np.stack([clip.texts[2], clip.pictures[1], clip.pictures[0]]), RTOL)


def test_tei_embed_takes_a_data_uri_as_an_image(clip: Clip) -> None:
    """A `data:image/` string is an image wherever a text goes (the input stage's rule)."""
    got = np.asarray(ok(clip.server.post("/embed", {"inputs": [data_uri(clip.pngs[2])]})))
    assert_rel_close(got[0], clip.pictures[2], RTOL)


# ---- rerank and score -----------------------------------------------------------------------


def cosines(query: np.ndarray, documents: np.ndarray) -> np.ndarray:
    return documents @ query  # rows normalized


def test_rerank_image_documents(clip: Clip) -> None:
    """Jina's `{"image"}` documents and vLLM's `{"content": [part]}` documents beside texts:
    the text query's cosine with each, best first; documents come back as given."""
    documents = [
        {"image": data_uri(clip.pngs[0]), "id": "first"},
        {"text": TEXTS[1]},
        {"content": [image_part(clip.host.url("/picture1.png"))]},
        TEXTS[2],
        {"image": clip.host.url("/picture2.png")},
    ]
    expected = cosines(
        clip.texts[0],
        np.stack(
            [clip.pictures[0], clip.texts[1], clip.pictures[1], clip.texts[2], clip.pictures[2]]
        ),
    )
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        body = {"model": "clip", "query": TEXTS[0], "documents": documents}
        results = ok(clip.server.post(path, body))["results"]
        assert [r["index"] for r in results] == list(np.argsort(-expected, kind="stable"))
        scores = np.asarray([r["relevance_score"] for r in results], np.float32)
        np.testing.assert_allclose(scores, np.sort(expected)[::-1], atol=RTOL)
        assert results[[r["index"] for r in results].index(0)]["document"] == documents[0]
    # vLLM's query as content parts: an image query against text documents.
    body = {"query": {"content": [image_part(data_uri(clip.pngs[1]))]}, "documents": TEXTS}
    results = ok(clip.server.post("/rerank", body))["results"]
    got = {r["index"]: r["relevance_score"] for r in results}
    expected = cosines(clip.pictures[1], clip.texts)
    np.testing.assert_allclose([got[i] for i in range(3)], expected, atol=RTOL)


@pytest.mark.parametrize(("first", "second"), [("data_1", "data_2"), ("queries", "documents")])
def test_score_with_content_parts(clip: Clip, first: str, second: str) -> None:
    items = [
        {"content": [image_part(data_uri(clip.pngs[0]))]},
        TEXTS[1],
        {"content": [text_part(TEXTS[2])]},
        {"content": [image_part(clip.host.url("/picture2.png"))]},
    ]
    body = {first: TEXTS[0], second: items}
    got = [d["score"] for d in ok(clip.server.post("/score", body))["data"]]
    rows = np.stack([clip.pictures[0], clip.texts[1], clip.texts[2], clip.pictures[2]])
    np.testing.assert_allclose(got, cosines(clip.texts[0], rows), atol=RTOL)
    # One item on each side, both as content: an image against a text.
    body = {first: items[0], second: {"content": [text_part(TEXTS[1])]}}
    got = [d["score"] for d in ok(clip.server.post("/v1/score", body))["data"]]
    np.testing.assert_allclose(got, [clip.pictures[0] @ clip.texts[1]], atol=RTOL)


# ---- the Python clients ---------------------------------------------------------------------


def test_openai_client(clip: Clip) -> None:
    """OpenAI's client sends `data:image/` strings in `input` (decoding the base64 answer
    itself), and vLLM's chat form through its generic `post`, as vLLM's example does."""
    client = openai.OpenAI(base_url=f"{clip.server.url}/v1", api_key="unused")
    answer = client.embeddings.create(model="clip", input=[TEXTS[0], data_uri(clip.pngs[1])])
    got = np.asarray([d.embedding for d in answer.data], np.float32)
    assert_rel_close(got, np.stack([clip.texts[0], clip.pictures[1]]), RTOL)
    chat = client.post(
        "/embeddings",
        cast_to=CreateEmbeddingResponse,
        body={
            "model": "clip",
            "messages": [{"role": "user", "content": [image_part(data_uri(clip.pngs[2]))]}],
            "encoding_format": "float",
        },
    )
    assert_rel_close(np.asarray(chat.data[0].embedding, np.float32), clip.pictures[2], RTOL)


def test_cohere_clients(clip: Clip) -> None:
    v2 = cohere.ClientV2(base_url=clip.server.url, api_key="unused")
    uris = [data_uri(png) for png in clip.pngs[:2]]
    answer = v2.embed(model="clip", input_type="image", images=uris, embedding_types=["float"])
    assert answer.embeddings.float_ is not None
    assert_rel_close(np.asarray(answer.embeddings.float_, np.float32), clip.pictures[:2], RTOL)
    inputs = [
        cohere.EmbedInput(content=[cohere.TextEmbedContent(text=TEXTS[1])]),
        cohere.EmbedInput(
            content=[cohere.ImageUrlEmbedContent(image_url=cohere.EmbedImageUrl(url=uris[0]))]
        ),
    ]
    answer = v2.embed(
        model="clip", input_type="search_document", inputs=inputs, embedding_types=["float"]
    )
    assert answer.embeddings.float_ is not None
    got = np.asarray(answer.embeddings.float_, np.float32)
    assert_rel_close(got, np.stack([clip.texts[1], clip.pictures[0]]), RTOL)
    v1 = cohere.Client(base_url=clip.server.url, api_key="unused")
    floats = v1.embed(model="clip", input_type="image", images=uris[1:])
    assert floats.response_type == "embeddings_floats"
    assert_rel_close(np.asarray(floats.embeddings, np.float32), clip.pictures[1:2], RTOL)


# ---- refusals -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "body", "param", "words"),
    [
        (
            "/v1/embeddings",
            {"messages": [{"role": "user", "content": [text_part("a"), image_part("x")]}]},
            "messages[0].content[1]",
            "only part",
        ),
        (
            "/v1/embeddings",
            {"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]},
            "messages",
            "one message",
        ),
        (
            "/pooling",
            {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
            "messages[0].content[0]",
            "an image part is",
        ),
        (
            "/v1/embeddings",
            {"messages": [{"role": "user", "content": [image_part("picture9.png")]}]},
            "messages",
            "no image file",
        ),
        ("/v1/embeddings", {"input": ["a", {"image": 7}]}, "input[1].image", "expected a string"),
        ("/v1/embeddings", {"input": ["a", {"image": "nope.png"}]}, "input[1]", "no image file"),
        (
            "/score",
            {"text_1": "a", "text_2": ["b", {"content": [{"type": "audio_url"}]}]},
            "text_2[1].content[0]",
            "'audio_url'",
        ),
        (
            "/rerank",
            {"query": "a", "documents": ["b", {"text": "c", "image": "d"}]},
            "documents[1]",
            "not both",
        ),
        (
            "/rerank",
            {"query": "a", "documents": ["b", {"image": "e.png"}]},
            "documents[1]",
            "e.png",
        ),
    ],
)
def test_refusals_name_the_input(
    clip: Clip, path: str, body: dict[str, Any], param: str, words: str
) -> None:
    response = clip.server.post(path, body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and words in error["message"], error


def test_cohere_refusals(clip: Clip) -> None:
    cases = [
        ({"texts": ["a"], "images": [data_uri(clip.pngs[0])]}, "give one of texts, images"),
        ({"texts": ["a"], "input_type": "image"}, "input_type image is for images"),
        ({"images": [data_uri(b"GIF89a")]}, "images[0]: the data: URI"),
        ({"images": [data_uri(clip.pngs[0]), 3]}, "images[1]"),
        (
            {"inputs": [{"content": [text_part("a"), image_part(data_uri(clip.pngs[0]))]}]},
            "inputs[0].content[1]",
        ),
    ]
    for body, words in cases:
        response = clip.server.post("/v2/embed", body)
        assert response.status_code == 400, response.text
        assert words in response.json()["message"], (body, response.text)
    infinity = clip.server.post("/embeddings", {"modality": "image", "input": ["a", 1]})
    assert infinity.status_code == 422 and infinity.json()["error"]["param"] == "input[1]"


def test_a_text_model_refuses_images_in_every_shape(server: Server) -> None:
    """The session's MiniLM server has no image tower: each shape's image is refused with
    that reason, in the route's own error shape."""
    uri = data_uri(encoded(sample_images(1)[0]))
    no_tower = "no image tower"
    for path, body in [
        ("/v1/embeddings", {"input": ["a", {"image": uri}]}),
        ("/v1/embeddings", {"input": ["a", uri]}),
        ("/v1/embeddings", {"messages": [{"role": "user", "content": [image_part(uri)]}]}),
        ("/rerank", {"query": "a", "documents": ["b", {"image": uri}]}),
        ("/score", {"data_1": "a", "data_2": {"content": [image_part(uri)]}}),
    ]:
        response = server.post(path, body)
        assert response.status_code == 400 and no_tower in response.text, (path, response.text)
    infinity = server.post("/embeddings", {"modality": "image", "input": [uri]})
    assert infinity.status_code == 400 and "ModelNotDeployedError" in infinity.text
    for body in ({"images": [uri]}, {"inputs": [{"content": [image_part(uri)]}]}):
        response = server.post("/v2/embed", body)
        assert response.status_code == 400 and no_tower in response.json()["message"]
    assert server.post("/v1/embeddings", {"input": ["a"]}).status_code == 200


def test_images_do_not_block_the_event_loop(clip: Clip) -> None:
    """An image URL that takes its time holds a media thread, not the event loop: a text call
    sent meanwhile is answered while the image is still held (its call unanswered), and the
    image's call once the image comes."""
    release = threading.Event()

    def held(handler: http.server.BaseHTTPRequestHandler) -> None:
        release.wait(120)  # only bounds a failure: the test releases it
        handler.send_response(200)
        handler.send_header("Content-Type", "image/png")
        handler.send_header("Content-Length", str(len(clip.pngs[0])))
        handler.end_headers()
        handler.wfile.write(clip.pngs[0])

    body = {"input": [{"image": clip.host.serve("/held.png", held)}]}
    results: list[httpx.Response] = []
    with httpx.Client(base_url=clip.server.url, timeout=60) as other:
        waiting = threading.Thread(
            target=lambda: results.append(other.post("/v1/embeddings", json=body))
        )
        waiting.start()
        deadline = time.monotonic() + 30
        while clip.host.hits.get("/held.png", 0) == 0:  # until the fetch is under way
            assert time.monotonic() < deadline, "the image was never fetched"
            time.sleep(0.01)
        text = clip.server.post("/v1/embeddings", {"input": [TEXTS[0]]})
        # Answered with the image still held: its call cannot have been answered yet.
        assert text.status_code == 200 and results == [] and waiting.is_alive()
        release.set()
        waiting.join(60)
    assert_rel_close(vectors(ok(text))[0], clip.texts[0], RTOL)
    assert_rel_close(vectors(ok(results[0]))[0], clip.pictures[0], RTOL)
