"""What the image benchmarks share (`bench_images.py`'s CLIP and vision-language parts): the
JPEG files, the text queries and the timer."""

from __future__ import annotations

import io
import time
from typing import Any

import numpy as np
import torch

QUERY_WORDS = [f"w{i}" for i in range(1000)]


def queries(count: int, seed: int = 0) -> list[str]:
    """`count` text queries of 6 to 24 words."""
    gen = np.random.default_rng(seed)
    return [" ".join(gen.choice(QUERY_WORDS, size=int(gen.integers(6, 25)))) for _ in range(count)]


def jpegs(count: int, width: int, height: int) -> list[bytes]:
    """`count` different JPEG files: a gradient, shapes and noise, quality 90."""
    from PIL import Image

    gen = np.random.default_rng(0)
    out = []
    ramp = np.linspace(0, 255, width)[None, :, None] * np.ones((height, 1, 3))
    for i in range(count):
        noise = gen.integers(0, 64, size=(height, width, 3))
        tint = np.array([i % 255, (3 * i) % 255, (7 * i) % 255])[None, None, :]
        pixels = np.clip(0.5 * ramp + 0.3 * tint + noise, 0, 255).astype(np.uint8)
        buffer = io.BytesIO()
        Image.fromarray(pixels).save(buffer, format="JPEG", quality=90)
        out.append(buffer.getvalue())
    return out


def timed(fn: Any) -> tuple[float, Any]:
    """`fn`'s wall seconds (the GPU's queue drained before and after) and its value."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    value = fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - start, value
