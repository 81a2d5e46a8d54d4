"""A refused request leaves nothing behind: the API app's answer to an expected error
releases what the error's frames held (its body, its decoded inputs) at once, by reference
counts, rather than in a reference cycle that waits for the collector's next full pass."""

from __future__ import annotations

import asyncio
import base64
import gc
import io
import json
import weakref
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch

import vecpool
from benchmarks.lab.bench_api_request import AnsweringClient, call
from vecpool.server import codec
from vecpool.server.app import create_api_app
from vecpool.server.config import ServerConfig


def _b64_torch(tensor: torch.Tensor) -> str:
    buf = io.BytesIO()
    torch.save(tensor, buf)
    return base64.b64encode(buf.getvalue()).decode()


def _b64_npy(array: np.ndarray) -> str:
    buf = io.BytesIO()
    np.save(buf, array, allow_pickle=False)
    return base64.b64encode(buf.getvalue()).decode()


@pytest.fixture
def collector_off() -> Iterator[None]:
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


@pytest.mark.parametrize("fast", [True, False], ids=["fast-path", "fastapi"])
@pytest.mark.parametrize(
    ("body", "status"),
    [
        # Over the model's 256 tokens: refused by the input stage, after decoding.
        ({"input": ["a", {"prompt_embeds": _b64_torch(torch.zeros(300, 384))}]}, 400),
        ({"input": [{"prompt_embeds": _b64_npy(np.zeros((300, 384), np.float32))}]}, 400),
        ({"input": [{"prompt_embeds": _b64_npy(np.zeros((3, 100), np.float32))}]}, 400),
        ({"input": [[101, 40000, 102]]}, 400),  # outside the vocabulary
        ({"input": "a", "dimensions": "8"}, 400),  # the body's schema
        ({"input": ["a", {"prompt_embeds": _b64_torch(torch.zeros(3, 384))}]}, 200),
    ],
)
def test_an_answered_request_leaves_no_reference_cycle(
    minilm: vecpool.Engine,
    monkeypatch: pytest.MonkeyPatch,
    collector_off: None,
    body: dict[str, Any],
    status: int,
    fast: bool,
) -> None:
    decoded: list[weakref.ref[np.ndarray]] = []
    decode = codec.decode_prompt_embeds

    def spy(data: str, index: int) -> np.ndarray:
        array = decode(data, index)
        decoded.append(weakref.ref(array))
        return array

    monkeypatch.setattr(codec, "decode_prompt_embeds", spy)
    app = create_api_app(minilm.info(), ServerConfig(model_names=("m",)), AnsweringClient(384))  # type: ignore[arg-type]
    if not fast:  # FastAPI's whole stack, as routes outside the fast path take
        app.fast_app = None

    async def run() -> int:
        async with app.router.lifespan_context(app):
            await call(app, json.dumps({"input": "warm"}).encode())
            gc.collect()
            return await call(app, json.dumps(body).encode())

    assert asyncio.run(run()) == status
    assert all(ref() is None for ref in decoded)  # freed with the answer, collector off
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        gc.collect()
        left = [type(o).__name__ for o in gc.garbage if isinstance(o, BaseException)]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
    assert left == []
