"""Images for the media tests: encoded noise, a bomb's header, an SVG; and `within`, the hang
guard of every call that could hang (a fetch, a FIFO): it fails the test if the call has not
returned after a few seconds. Nothing else about time is asserted."""

from __future__ import annotations

import io
import struct
import threading
import zlib
from collections.abc import Callable
from typing import Any

import numpy as np
from PIL import Image

HANG_GUARD_S = 10.0


def within(call: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """`call(*args, **kwargs)`, failing the test if it has not returned after HANG_GUARD_S."""
    result: dict[str, Any] = {}

    def run() -> None:
        try:
            result["value"] = call(*args, **kwargs)
        except BaseException as exc:
            result["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(HANG_GUARD_S)
    assert not thread.is_alive(), f"still running after {HANG_GUARD_S} s"
    if "error" in result:
        raise result["error"]
    return result["value"]


def noise(width: int, height: int, channels: int = 3, seed: int = 0) -> np.ndarray:
    shape = (height, width, channels) if channels > 1 else (height, width)
    return np.random.default_rng(seed).integers(0, 256, shape, dtype=np.uint8)


def encoded(image: Image.Image, fmt: str, **options: Any) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, fmt, **options)
    return buffer.getvalue()


def png_header(width: int, height: int) -> bytes:
    """A PNG whose header claims `width` x `height` 8-bit grey pixels, with one tiny data
    chunk: a decompression bomb's shape, refused before anything is decoded."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        body = kind + data
        return struct.pack(">I", len(data)) + body + struct.pack(">I", zlib.crc32(body))

    header = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", header)
        + chunk(b"IDAT", zlib.compress(b"\x00" * 64))
        + chunk(b"IEND", b"")
    )


RGB = Image.fromarray(noise(37, 23))
PNG = encoded(RGB, "PNG")
SVG = b'<?xml version="1.0"?>\n<svg xmlns="http://www.w3.org/2000/svg" width="4" height="4"/>'


def pixels(image: Image.Image) -> np.ndarray:
    return np.asarray(image)
