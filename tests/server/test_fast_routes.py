"""The app's fast path (`app.App`): a POST to a work route runs its endpoint without FastAPI's
router and middleware, and answers every body, good or hostile, exactly as the FastAPI path
does (status, headers, body; ids and clocks aside)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import httpx
import pytest

import vecpool
from tests.server.asgi import NAME, tiny_model_folder
from tests.server.test_hostile import RAW_BODIES, post_routes
from vecpool.server.app import App, create_app
from vecpool.server.config import ServerConfig

VALID_BODIES = [
    ("one text", b'{"input": "hello there"}', {}),
    ("two texts, base64", b'{"input": ["a b", "c"], "encoding_format": "base64"}', {}),
    ("token ids", b'{"input": [[101, 7592, 102]], "model": "%s"}' % NAME.encode(), {}),
    ("unknown model", b'{"input": "x", "model": "nope"}', {}),
    ("rerank", b'{"query": "q", "documents": ["a", "b c"], "top_n": 1}', {}),
    ("score", b'{"text_1": "q", "text_2": ["a", "b"]}', {}),
    ("tei", b'{"inputs": ["a", "b"]}', {}),
    ("cohere", b'{"texts": ["a"], "input_type": "search_query"}', {}),
    ("tokenize", b'{"prompt": "hello"}', {}),
    ("wrong key", b'{"input": "x"}', {"authorization": "Bearer wrong"}),
]
# Headers that carry a clock or an id.
_VARYING = {"date", "x-tokenization-time", "x-queue-time", "x-inference-time", "metadata"}


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path) -> vecpool.Engine:
    folder = tiny_model_folder(tmp_path_factory.mktemp("tiny"), default_model_dir)
    return vecpool.Engine(folder, device="cpu", max_model_len=128)


def _without_ids(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _without_ids(v) for k, v in value.items() if k not in ("id", "created")}
    if isinstance(value, list):
        return [_without_ids(v) for v in value]
    return value


def _answer(response: httpx.Response) -> tuple[int, dict[str, str], Any]:
    headers = {k: v for k, v in response.headers.items() if k not in _VARYING}
    try:
        body: Any = _without_ids(response.json())
        headers.pop("content-length", None)  # an id's length may differ
    except ValueError:
        body = response.content
    return response.status_code, headers, body


@pytest.mark.parametrize("api_key", [None, "secret"])
def test_every_work_route_answers_on_the_fast_path_as_through_fastapi(
    engine: vecpool.Engine, api_key: str | None
) -> None:
    async def scenario() -> int:
        app = create_app(engine, ServerConfig(model_names=(NAME,), api_key=api_key))
        assert isinstance(app, App)
        fast = app.fast_app
        auth = {"authorization": f"Bearer {api_key}"} if api_key else {}
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
                spec = (await client.get("/openapi.json", headers=auth)).json()
                routes = post_routes(spec)
                # Every route that takes a POST is on the fast path.
                assert {path for _, path in app.fast_routes} == set(routes)
                compared = 0
                for route in routes:
                    for name, body, extra in [*VALID_BODIES, *RAW_BODIES]:
                        headers = {"content-type": "application/json", **auth, **extra}
                        answers = []
                        for path in (fast, None):  # the fast path, then FastAPI's
                            app.fast_app = path
                            response = await client.post(route, content=body, headers=headers)
                            answers.append(_answer(response))
                        app.fast_app = fast
                        assert answers[0] == answers[1], (route, name)
                        compared += 1
                return compared

    assert asyncio.run(scenario()) >= 20 * (len(VALID_BODIES) + len(RAW_BODIES))


def test_the_fast_path_skips_fastapis_stack_and_other_requests_take_it(
    engine: vecpool.Engine,
) -> None:
    async def scenario() -> None:
        app = create_app(engine, ServerConfig(model_names=(NAME,)))
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
                stack = app.middleware_stack or app.build_middleware_stack()
                seen: list[tuple[str, str]] = []

                async def recorded(scope: Any, receive: Any, send: Any) -> None:
                    seen.append((scope["method"], scope["path"]))
                    await stack(scope, receive, send)

                app.middleware_stack = recorded
                response = await client.post("/v1/embeddings", json={"input": "hello"})
                assert response.status_code == 200 and len(response.json()["data"]) == 1
                assert seen == []
                # A GET, a method the route lacks, an unknown path: FastAPI's, as before.
                assert (await client.get("/v1/models")).status_code == 200
                assert (await client.get("/v1/embeddings")).status_code == 405
                assert (await client.post("/v1/nothing", json={})).status_code == 404
                assert seen == [
                    ("GET", "/v1/models"),
                    ("GET", "/v1/embeddings"),
                    ("POST", "/v1/nothing"),
                ]

    asyncio.run(scenario())


def test_an_unexpected_error_on_the_fast_path_is_a_logged_500_and_the_app_goes_on(
    engine: vecpool.Engine, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from vecpool.server.routes import embeddings

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("a bug")

    async def scenario() -> None:
        app = create_app(engine, ServerConfig(model_names=(NAME,)))
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
                with monkeypatch.context() as m:
                    m.setattr(embeddings, "quantization", broken)
                    response = await client.post("/v1/embeddings", json={"input": "hello"})
                assert response.status_code == 500
                assert response.headers["connection"] == "close"
                assert json.loads(response.content)["error"]["code"] == "internal_error"
                response = await client.post("/v1/embeddings", json={"input": "hello"})
                assert response.status_code == 200

    asyncio.run(scenario())
    assert any("unexpected error answering /v1/embeddings" in r.message for r in caplog.records)


def test_a_middleware_added_after_the_app_was_built_sees_every_request(
    engine: vecpool.Engine,
) -> None:
    seen: list[str] = []

    class Recording:
        def __init__(self, app: Any) -> None:
            self.app = app

        async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
            seen.append(scope["path"])
            await self.app(scope, receive, send)

    async def scenario() -> None:
        app = create_app(engine, ServerConfig(model_names=(NAME,)))
        app.add_middleware(Recording)  # as a user adds CORS to the app
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
                response = await client.post("/v1/embeddings", json={"input": "hello"})
                assert response.status_code == 200 and len(response.json()["data"]) == 1

    asyncio.run(scenario())
    assert seen == ["/v1/embeddings"]
