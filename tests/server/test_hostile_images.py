"""Hostile images against a live `vecpool serve` of a tiny CLIP folder: corrupt, truncated,
empty, not an image, SVG, decompression bombs (a pixel count over the cap, read from the
header), over the byte cap, a URL that drips its body past the request's deadline, a redirect
loop and a redirect to a host not allowed, a host, a scheme, a path, a `..` escape and a
symlink escape not allowed.

Each is a 4xx in the route's own error shape naming the input's index and the reason, within a
hang guard (`GUARD` seconds, far above what each takes), in every dialect that takes images;
the server serves a normal request afterwards, and the API process's memory is back near its
level after rounds of bombs and of large images that are allowed (`MEMORY_SLACK_MIB`).

URLs are a local HTTP server in a thread (`ImageHost`), its host allowed with
`--allowed-media-domains 127.0.0.1 localhost`. One server for the module.
"""

from __future__ import annotations

import base64
import http.server
import struct
import time
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
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
from tests.server.test_images import (
    ImageHost,
    clip_args,
    data_uri,
    image_part,
    reference_clip,
    unit,
)
from tests.server.test_process_memory import _rss_mib
from tests.server.test_processes import _pids

GUARD = 30.0  # seconds: a request still unanswered by then hangs
MAX_IMAGE_BYTES = 1 << 20  # the server's --max-image-bytes
TEXT = "a photo of a cat"
RTOL = 1e-5  # as tests/server/test_images.py: fp32, other kernel shapes than transformers'


# ---- hostile files --------------------------------------------------------------------------


def png_chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def png_bomb(side: int) -> bytes:
    """A real decompression bomb: a 1-bit PNG of `side` x `side` zero pixels (`side`^2 / 8
    bytes once inflated), a few kilobytes compressed."""
    row = b"\x00" * (1 + (side + 7) // 8)  # filter byte, then the packed row
    packer = zlib.compressobj(9)
    chunks = [packer.compress(row) for _ in range(side)]
    idat = b"".join(chunks) + packer.flush()
    header = struct.pack(">IIBBBBB", side, side, 1, 0, 0, 0, 0)  # 1-bit grayscale
    return (
        b"\x89PNG\r\n\x1a\n"
        + png_chunk(b"IHDR", header)
        + png_chunk(b"IDAT", idat)
        + (png_chunk(b"IEND", b""))
    )


def jpeg_bomb(side: int = 60000) -> bytes:
    """A small JPEG whose frame header (SOF0) says `side` x `side` pixels."""
    data = bytearray(encoded(Image.new("L", (8, 8)), "JPEG"))
    at = data.index(b"\xff\xc0")  # SOF0: marker, length (2), precision (1), height, width
    data[at + 5 : at + 9] = struct.pack(">HH", side, side)
    return bytes(data)


def noise_png(side: int, seed: int = 0) -> bytes:
    """An RGB PNG of random pixels: about 3 * side^2 bytes, incompressible."""
    pixels = np.random.default_rng(seed).integers(0, 256, (side, side, 3), dtype=np.uint8)
    return encoded(Image.fromarray(pixels), "PNG")


def corrupt(png: bytes) -> bytes:
    """`png` with the bytes of its image data flipped: every chunk intact in length, the data
    chunk's checksum wrong."""
    at = png.index(b"IDAT") + 8
    return png[:at] + bytes(b ^ 0xFF for b in png[at : at + 32]) + png[at + 32 :]


SVG = b'<?xml version="1.0"?><svg xmlns="http://www.w3.org/2000/svg" width="9" height="9"/>'


# ---- fixtures -------------------------------------------------------------------------------


@dataclass
class Hostile:
    server: Server
    host: ImageHost
    media: Path
    png: bytes
    picture: np.ndarray  # the normalized image features of `png`
    text: np.ndarray  # the normalized text features of TEXT
    sources: dict[str, tuple[str, str]]  # name -> (image source, the reason's words)
    drips: list[int]  # the bytes each dripping response had sent when its client went away


def drip(drips: list[int]) -> Any:
    """A route that promises 100,000 bytes and sends one every 50 ms (for up to `GUARD`
    seconds), noting how many it had sent when its client goes away."""

    def route(handler: http.server.BaseHTTPRequestHandler) -> None:
        handler.send_response(200)
        handler.send_header("Content-Type", "image/png")
        handler.send_header("Content-Length", "100000")
        handler.end_headers()
        end = time.monotonic() + GUARD  # only bounds a failure: the client goes first
        sent = 0
        try:
            while time.monotonic() < end:
                handler.wfile.write(b"\x89")
                handler.wfile.flush()
                sent += 1
                time.sleep(0.05)
        except OSError:  # the client closed its socket
            drips.append(sent)

    return route


def redirect(location: str) -> Any:
    def route(handler: http.server.BaseHTTPRequestHandler) -> None:
        handler.send_response(302)
        handler.send_header("Location", location)
        handler.send_header("Content-Length", "0")
        handler.end_headers()

    return route


def _hostile_args(root: Path) -> list[str]:
    """The module's server: a tiny CLIP folder (`root/model`), a picture under `root/media`
    (allowed), another beside it (not allowed) and a link to that one in `media`."""
    save_tiny_dual_encoder(root / "model", CLIP)
    media = root / "media"
    media.mkdir()
    png = encoded(sample_images(1)[0], "PNG")
    (media / "picture.png").write_bytes(png)
    (root / "secret.png").write_bytes(png)  # a readable image outside the allowed folder
    (media / "link.png").symlink_to(root / "secret.png")
    return clip_args(root / "model", media, "--max-image-bytes", str(MAX_IMAGE_BYTES))


# Fetches may take an hour to arrive (`tests/server/media_reads.py`): one cut off within GUARD
# was cut by the request's deadline.
SERVERS = {
    "hostile": ServerSpec(_hostile_args, log_level="info", module="tests.server.media_reads")
}


@pytest.fixture(scope="module")
def hostile(server_pool: ServerPool, request: pytest.FixtureRequest) -> Iterator[Hostile]:
    server = server_pool.take(request, "hostile")
    root = server_pool.folder(request, "hostile")
    folder, media = root / "model", root / "media"
    hf = reference_clip(folder)
    (image,) = sample_images(1)
    png = encoded(image, "PNG")
    host = ImageHost()
    drips: list[int] = []
    bomb, big = png_bomb(10_000), noise_png(700)  # 100M pixels; 1.4 MiB
    assert len(bomb) < 64 * 1024 and len(big) > MAX_IMAGE_BYTES
    host.serve_bytes("/picture.png", png)
    host.serve_bytes("/bomb.png", bomb)
    host.serve_bytes("/big.png", big)
    host.serve_bytes("/drawing.svg", SVG, "image/svg+xml")
    host.serve("/slow.png", drip(drips))
    host.serve("/loop", redirect("/loop"))
    host.serve("/away", redirect("http://images.example.com/picture.png"))
    too_many = f"over the limit of {MAX_IMAGE_BYTES:,} bytes"
    too_large = "pixels, over the limit of"
    outside = "outside the allowed --allowed-local-media-path"
    sources = {
        "corrupt": (data_uri(corrupt(png)), "a corrupt or truncated PNG"),
        "truncated": (data_uri(png[: len(png) // 2]), "a corrupt or truncated PNG"),
        "empty": ("data:image/png;base64,", "empty, no image data"),
        "not an image": (data_uri(b"hello, I am plain text, honest"), "not an image"),
        "svg": (data_uri(SVG, "image/svg+xml"), "SVG"),
        "svg as png": (data_uri(SVG), "SVG"),
        "svg url": (host.url("/drawing.svg"), "SVG"),
        "png bomb": (data_uri(bomb), too_large),
        "png bomb url": (host.url("/bomb.png"), too_large),
        "jpeg bomb": (base64.b64encode(jpeg_bomb()).decode(), too_large),
        "over the byte cap": (data_uri(big), too_many),
        "over the byte cap url": (host.url("/big.png"), too_many),
        "missing url": (host.url("/nothing.png"), "HTTP 404"),
        "redirect loop": (host.url("/loop"), "more than 3 redirects"),
        "redirect away": (host.url("/away"), "'images.example.com' is not among"),
        "forbidden host": ("http://images.example.com/picture.png", "is not among"),
        "forbidden scheme": (f"ftp://127.0.0.1:{host.port}/picture.png", "are not fetched"),
        "forbidden path": ("/etc/hostname", outside),
        "dot-dot escape": ("../secret.png", outside),
        "symlink escape": ("link.png", outside),
        "file url escape": (f"file://{root / 'secret.png'}", outside),
    }
    picture = unit(hf_image_features(hf, folder, [image]))[0]
    text = unit(hf_text_features(hf, folder, [TEXT]))[0]
    yield Hostile(server, host, media, png, picture, text, sources, drips)
    server.stop()
    host.close()


def post(hostile: Hostile, path: str, body: Any, **headers: str) -> httpx.Response:
    """`body` posted within the hang guard (httpx raises past it)."""
    return hostile.server.client.post(path, json=body, headers=headers, timeout=GUARD)


def serves_normally(hostile: Hostile) -> None:
    """The server is healthy: a text and an image in one request, each its right vector."""
    assert hostile.server.client.get("/health").status_code == 200
    body = {"input": [TEXT, {"image": data_uri(hostile.png)}]}
    response = post(hostile, "/v1/embeddings", body)
    assert response.status_code == 200, response.text
    got = np.asarray([d["embedding"] for d in response.json()["data"]], np.float32)
    assert_rel_close(got, np.stack([hostile.text, hostile.picture]), RTOL)


# ---- every hostile source, then every dialect -----------------------------------------------

NAMES = [
    "corrupt",
    "truncated",
    "empty",
    "not an image",
    "svg",
    "svg as png",
    "svg url",
    "png bomb",
    "png bomb url",
    "jpeg bomb",
    "over the byte cap",
    "over the byte cap url",
    "missing url",
    "redirect loop",
    "redirect away",
    "forbidden host",
    "forbidden scheme",
    "forbidden path",
    "dot-dot escape",
    "symlink escape",
    "file url escape",
]


@pytest.mark.parametrize("name", NAMES)
def test_each_hostile_image_is_a_400_naming_the_input(hostile: Hostile, name: str) -> None:
    source, reason = hostile.sources[name]
    loops = hostile.host.hits.get("/loop", 0)
    response = post(hostile, "/v1/embeddings", {"input": [TEXT, {"image": source}]})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "input[1]", error
    assert error["message"].startswith("input 1: ") and reason in error["message"], error
    if name == "redirect loop":  # followed --max-redirects (3) times, then refused
        assert hostile.host.hits["/loop"] - loops == 4
    serves_normally(hostile)


def test_every_name_has_a_case(hostile: Hostile) -> None:
    assert sorted(NAMES) == sorted(hostile.sources)


# (path, body with the bad source at input 1, status, the error's place, where it names it)
def dialects(source: str, good: str) -> list[tuple[str, dict[str, Any], int, str, str]]:
    message = [{"role": "user", "content": [image_part(source)]}]
    return [
        (
            "/v1/embeddings",
            {"input": [{"image": good}, {"image": source}]},
            400,
            "param",
            "input[1]",
        ),
        ("/v1/embeddings", {"messages": message}, 400, "param", "messages"),
        ("/pooling", {"messages": message}, 400, "param", "messages"),
        ("/embeddings", {"modality": "image", "input": [good, source]}, 422, "param", "input[1]"),
        ("/v1/embed", {"images": [good, source]}, 400, "message", "images[1]: "),
        (
            "/v2/embed",
            {"inputs": [{"content": [image_part(good)]}, {"content": [image_part(source)]}]},
            400,
            "message",
            "inputs[1]: ",
        ),
        (
            "/v1/rerank",
            {"query": TEXT, "documents": [{"image": good}, {"image": source}]},
            400,
            "param",
            "documents[1]",
        ),
        (
            "/rerank",
            {"query": TEXT, "documents": [good, {"content": [image_part(source)]}]},
            400,
            "param",
            "documents[1]",
        ),
        (
            "/score",
            {"data_1": TEXT, "data_2": [good, {"content": [image_part(source)]}]},
            400,
            "param",
            "data_2[1]",
        ),
    ]


@pytest.mark.parametrize("name", ["corrupt", "png bomb url", "forbidden host", "dot-dot escape"])
def test_every_dialect_answers_in_its_own_shape(hostile: Hostile, name: str) -> None:
    source, reason = hostile.sources[name]
    for path, body, status, key, where in dialects(source, data_uri(hostile.png)):
        response = post(hostile, path, body)
        assert response.status_code == status, (path, response.text)
        answer = response.json()
        if key == "param":  # OpenAI's and vLLM's shape (Infinity's too, with its 422)
            error = answer["error"]
            assert error["param"] == where and reason in error["message"], (path, error)
        else:  # Cohere's {"id", "message"}
            assert set(answer) == {"id", "message"}, answer
            assert answer["message"].startswith(where) and reason in answer["message"], answer
    serves_normally(hostile)


def test_a_url_past_the_request_deadline(hostile: Hostile) -> None:
    """A host that drips its image (a byte every 50 ms, for GUARD seconds): the request's
    deadline (x-request-timeout) ends the fetch, not the media policy's read timeout, which
    this server has at an hour (`media_reads.READ_SECONDS`): a 408 for the deadline, and the
    fetch's connection closed (its media thread free again) while the host still drips."""
    drips = len(hostile.drips)
    body = {"input": [TEXT, {"image": hostile.host.url("/slow.png")}]}
    response = post(hostile, "/v1/embeddings", body, **{"x-request-timeout": "1"})
    assert response.status_code == 408, response.text
    assert response.json()["error"]["code"] == "deadline_exceeded"
    guard = time.monotonic() + GUARD  # only bounds a failure, far below READ_SECONDS
    while len(hostile.drips) == drips:  # the host notes its client gone (not its own end)
        assert time.monotonic() < guard, "the fetch was never cut off"
        time.sleep(0.01)
    serves_normally(hostile)


MEMORY_ROUNDS = 8
# The API process may keep what its allocator cached for the image threads (glibc keeps a
# freed block in its thread's arena, and each media thread has one, up to 64 MiB reserved
# though little of it is resident) and what Pillow's first decodes of each format loaded. What
# is measured is after a round of each kind has run once (those caches warm); the slack is
# for the allocator's arenas growing by a block or two, well under one large image's pixels
# (2,500 x 2,500 RGB: 18 MiB, times the rounds: 150 MiB if each were kept).
MEMORY_SLACK_MIB = 32


def test_memory_comes_back_after_bombs_and_large_images(hostile: Hostile) -> None:
    _, (api,) = _pids(hostile.server)
    # Large images the caps allow (6.25M pixels, each decoded and resized), beside the bombs.
    large = data_uri(encoded(Image.new("RGB", (2500, 2500), (200, 30, 90)), "PNG"))
    bombs = [hostile.sources[name][0] for name in ("png bomb", "png bomb url", "jpeg bomb")]

    def one_round() -> None:
        for source in bombs:
            response = post(hostile, "/v1/embeddings", {"input": [{"image": source}]})
            assert response.status_code == 400, response.text
        response = post(hostile, "/v1/embeddings", {"input": [{"image": large}] * 2})
        assert response.status_code == 200, response.text

    one_round()
    serves_normally(hostile)
    before = _rss_mib(api)
    for _ in range(MEMORY_ROUNDS):
        one_round()
    serves_normally(hostile)
    after = _rss_mib(api)
    print(f"\nAPI process RSS: {before:.0f} MiB, after {MEMORY_ROUNDS} rounds {after:.0f} MiB")
    assert after - before < MEMORY_SLACK_MIB, (before, after)
