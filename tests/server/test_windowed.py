"""Windowed embedding over HTTP: `/v1/embeddings` with `"windowed": true` (or a server started
with `--windowed-embed`) gives exactly what `Engine.embed(..., windowed=True)` gives, and an
input over the model's length is refused without it. The same engine computes both, in calls of
the same inputs, so the vectors are compared exactly."""

from __future__ import annotations

import asyncio
import base64
from pathlib import Path

import numpy as np
import pytest

import vecpool
from tests.conftest import make_st_folder
from tests.server.asgi import serving

LIMIT = 64  # the folder's max_seq_length


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path) -> Path:
    return make_st_folder(
        tmp_path_factory.mktemp("windowed"),
        default_model_dir,
        pooling="pooling_mode_mean_tokens",
        dense_out=24,
        normalize=True,
    )


def _vectors(response) -> np.ndarray:
    assert response.status_code == 200, response.text
    rows = [base64.b64decode(d["embedding"]) for d in response.json()["data"]]
    return np.stack([np.frombuffer(r, dtype=np.float32) for r in rows])


def test_windowed_over_http_equals_the_engine(folder: Path) -> None:
    long_text = " ".join(["river stone cloud amber signal harbor"] * 40)
    inputs = [long_text, "a short input"]
    engine = vecpool.Engine(folder, device="cpu")
    assert len(engine.tokenize(long_text)) > 3 * LIMIT
    expected = engine.embed(inputs, windowed=True)
    body = {"input": inputs, "encoding_format": "base64"}

    async def scenario() -> None:
        async with serving(engine) as (client, _):
            refused = await client.post("/v1/embeddings", json=body)
            assert refused.status_code == 400
            assert "maximum context length" in refused.json()["error"]["message"]
            got = _vectors(await client.post("/v1/embeddings", json={**body, "windowed": True}))
            assert np.array_equal(got, expected)
        by_default = vecpool.Engine(folder, device="cpu", windowed_embed=True)
        async with serving(by_default) as (client, _):
            got = _vectors(await client.post("/v1/embeddings", json=body))
            assert np.array_equal(got, by_default.embed(inputs))
            refused = await client.post("/v1/embeddings", json={**body, "windowed": False})
            assert refused.status_code == 400

    asyncio.run(scenario())
