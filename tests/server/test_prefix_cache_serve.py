"""`vecpool serve --enable-prefix-caching`: the flag reaches the engine process, and the
engine's prefix cache counters reach `/metrics` through the processes' shared directory."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.engine.test_prefix_cache import QWEN3, B, _shared
from tests.helpers import save_hf_model
from tests.server.conftest import Server, ServerPool, ServerSpec


def _qwen3(folder: Path) -> list[str]:
    model = save_hf_model(QWEN3.hf_model(), folder / "qwen3")
    return [str(model), "--device", "cpu", "--enable-prefix-caching", "--prefix-cache-tokens", "64"]


SERVERS = {"prefix_server": ServerSpec(_qwen3)}


@pytest.fixture
def prefix_server(server_pool: ServerPool, request: pytest.FixtureRequest) -> Server:
    return server_pool.take(request, "prefix_server")


def test_serve_counts_prefix_cache_tokens(prefix_server: Server) -> None:
    server = prefix_server
    try:
        prompts = _shared(2 * B + 1, [2, 7])  # 35 and 40 ids: the shorter reads 2 blocks
        response = server.post("/v1/embeddings", {"input": prompts})
        assert response.status_code == 200, response.text
        assert server.wait_for("vecpool_prefix_cache_hit_tokens_total", lambda v: v > 0) == 2 * B
        assert server.metric("vecpool_prefix_cache_queried_tokens_total") == 35 + 40
    finally:
        server.stop()
