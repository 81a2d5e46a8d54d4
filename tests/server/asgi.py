"""An app served in this process through httpx's ASGI transport: no sockets, no subprocess,
milliseconds a request. For the tests that send thousands of requests or hold the engine."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import transformers

import vecpool
from tests.helpers import save_hf_model
from tests.tasks.conftest import tiny_bert_head, with_minilm_tokenizer
from vecpool.server.app import create_app
from vecpool.server.config import ServerConfig
from vecpool.server.state import ServerState

NAME = "tiny"


def tiny_model_folder(folder: Path, default_model_dir: Path) -> Path:
    """A random 2-layer BERT of width 32 on the MiniLM vocabulary and tokenizer."""
    save_hf_model(tiny_bert_head(transformers.BertModel), folder)
    return with_minilm_tokenizer(folder, default_model_dir)


@asynccontextmanager
async def serving(
    engine: vecpool.Engine, **config: Any
) -> AsyncIterator[tuple[httpx.AsyncClient, ServerState]]:
    """A client of `create_app(engine, ServerConfig(**config))`, its lifespan running, and
    the app's state."""
    app = create_app(engine, ServerConfig(model_names=(NAME,), **config))
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            yield client, app.state.vecpool


def error_shape(response: httpx.Response) -> str:
    """Which error shape the body has: "openai", "tei" or "cohere"; fails on any other."""
    assert response.headers["content-type"].startswith("application/json"), response.text
    body = response.json()
    if isinstance(body.get("error"), dict):
        assert set(body["error"]) == {"message", "type", "param", "code"}, body
        assert isinstance(body["error"]["message"], str) and body["error"]["message"]
        return "openai"
    if set(body) == {"error", "error_type"}:
        return "tei"
    assert set(body) == {"id", "message"}, body
    return "cohere"
