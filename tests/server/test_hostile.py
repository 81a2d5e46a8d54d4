"""Hostile bodies, hand-made and generated from the app's own OpenAPI document, against every
route of an app in this process: never a 5xx, every refusal in its route's error shape, and the
server healthy afterwards."""

from __future__ import annotations

import asyncio
import base64
import gzip
import io
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import vecpool
from tests.server.asgi import error_shape, serving, tiny_model_folder

DEEP = 5000  # past Python's recursion limit


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path) -> vecpool.Engine:
    folder = tiny_model_folder(tmp_path_factory.mktemp("tiny"), default_model_dir)
    return vecpool.Engine(folder, device="cpu", max_model_len=128)


def npy_b64(array: np.ndarray) -> str:
    buffer = io.BytesIO()
    np.save(buffer, array)
    return base64.b64encode(buffer.getvalue()).decode()


def nested(depth: int, leaf: Any = 1) -> Any:
    value = leaf
    for _ in range(depth):
        value = [value]
    return value


def deep_json(key: str, depth: int) -> bytes:
    """`{"input": "x", key: [[[...]]]}` nested `depth` deep, written without recursion."""
    return b'{"input": "x", "%s": %s1%s}' % (key.encode(), b"[" * depth, b"]" * depth)


HUGE = np.full((3, 32), 3e38, dtype=np.float32)  # finite, but overflows the model
RAW_BODIES: list[tuple[str, bytes, dict[str, str]]] = [
    ("deep input", b'{"input": %s1%s}' % (b"[" * DEEP, b"]" * DEEP), {}),
    ("deep user", deep_json("user", DEEP), {}),
    ("deep object", b'{"input": "x", "user": %s1%s}' % (b'{"a":' * DEEP, b"}" * DEEP), {}),
    ("900 deep", deep_json("input", 900), {}),
    ("bom", b'\xef\xbb\xbf{"input": "hello"}', {}),
    ("utf-16", '{"input": "hello"}'.encode("utf-16"), {}),
    ("utf-16-le", '{"input": "hello"}'.encode("utf-16-le"), {}),
    ("duplicate keys", b'{"input": "hello", "input": "bye"}', {}),
    ("text/plain", b'{"input": "hello"}', {"content-type": "text/plain"}),
    ("form", b"input=hello", {"content-type": "application/x-www-form-urlencoded"}),
    (
        "lone surrogate",
        b'{"input": "abc\\ud800", "query": "q\\udfff", "documents": ["\\ud800"]}',
        {},
    ),
    ("bad utf-8", b'{"input": "\xff\xfe\xfd"}', {}),
    ("nan", b'{"input": "x", "dimensions": NaN}', {}),
    ("huge int", b'{"input": [[101, %d, 102]]}' % 2**70, {}),
    ("step tag 2^63", b'{"input": "x", "task": "token_classify", "step_tag_id": %d}' % 2**63, {}),
    ("step tag -1", b'{"input": "x", "task": "token_classify", "step_tag_id": -1}', {}),
    ("not json", b"{input: hello", {}),
    ("array", b'["hello"]', {}),
    ("empty", b"", {}),
    ("null bytes", b'{"input": "a\\u0000b"}', {}),
    (
        "huge embeds",
        json.dumps({"input": [{"prompt_embeds": npy_b64(HUGE)}]}).encode(),
        {},
    ),
]


def post_routes(app_openapi: dict[str, Any]) -> list[str]:
    return sorted(p for p, item in app_openapi["paths"].items() if "post" in item)


def check_answer(response: httpx.Response, *, allow_ok: bool = True) -> None:
    assert response.status_code < 500, (response.request.url, response.text[:500])
    if response.status_code >= 400:
        error_shape(response)
    else:
        assert allow_ok, response.text[:200]


def test_hand_made_hostile_bodies(engine: vecpool.Engine) -> None:
    async def scenario() -> int:
        async with serving(engine) as (client, _):
            routes = post_routes((await client.get("/openapi.json")).json())
            assert len(routes) >= 20
            sent = 0
            for route in routes:
                for name, body, headers in RAW_BODIES:
                    headers = {"content-type": "application/json", **headers}
                    response = await client.post(route, content=body, headers=headers)
                    sent += 1
                    assert response.status_code < 500, (route, name, response.text[:300])
                    if name not in ("900 deep", "null bytes"):  # may be fine on some routes
                        assert 400 <= response.status_code < 500, (route, name, response.text)
                    if response.status_code >= 400:
                        error_shape(response)
            response = await client.post(
                "/v1/embeddings", content=b'{"input": "x"}', headers={"content-type": "text/plain"}
            )
            assert response.status_code == 415 and "application/json" in response.text
            for coding, content in (("gzip", gzip.compress(b'{"input": "x"}')), ("br", b"{}")):
                response = await client.post(
                    "/v1/embeddings", content=content, headers={"content-encoding": coding}
                )
                assert response.status_code == 415, response.text
                assert f"content-encoding: {coding}" in response.text
            response = await client.post(
                "/v1/embeddings", json={"input": "x"}, headers={"content-encoding": "identity"}
            )
            assert response.status_code == 200, response.text
            response = await client.post("/v1/embeddings", content=b'{"input": "a", "input": "b"}')
            assert response.status_code == 400 and "'input' twice" in response.text
            assert (await client.head("/health")).status_code == 200
            assert (await client.get("/health")).status_code == 200
            ok = await client.post("/v1/embeddings", json={"input": ["hello", "world"]})
            assert ok.status_code == 200 and len(ok.json()["data"]) == 2
            return sent

    assert asyncio.run(scenario()) >= 20 * len(RAW_BODIES)


def test_a_per_token_answer_over_its_limit_is_refused_before_it_runs(
    engine: vecpool.Engine,
) -> None:
    """A per-token answer grows with tokens times width, not with the body: over
    `max_answer_values` it is refused naming the limit (400; TEI's `/embed_all` 422),
    before the engine runs anything; at the limit, and pooled tasks of the same inputs, 200."""
    width = engine.info().token_output_dim
    ids = [101] + [7592] * 8 + [102]  # 10 tokens
    limit = 3 * len(ids) * width  # three inputs' rows

    async def scenario() -> None:
        async with serving(engine, max_answer_values=limit) as (client, _):
            fits = await client.post("/pooling", json={"input": [ids] * 3, "task": "token_embed"})
            assert fits.status_code == 200, fits.text
            assert [np.shape(d["data"]) for d in fits.json()["data"]] == [(10, width)] * 3
            steps = engine.core.num_steps
            for route, body, status in (
                ("/pooling", {"input": [ids] * 4, "task": "token_embed"}, 400),
                ("/embed_all", {"inputs": [ids] * 4}, 422),  # TEI's status for a refusal
            ):
                over = await client.post(route, json=body)
                assert over.status_code == status, over.text
                assert f"about {4 * 10 * width:,} values" in over.text
                assert f"over the server's limit of {limit:,}" in over.text
            assert engine.core.num_steps == steps  # refused before it ran
            pooled = await client.post("/pooling", json={"input": [ids] * 4, "task": "embed"})
            assert pooled.status_code == 200, pooled.text

    asyncio.run(scenario())


# ---- the schema fuzzer ------------------------------------------------------------------


def _resolve(schema: dict[str, Any], spec: dict[str, Any]) -> dict[str, Any]:
    while "$ref" in schema:
        node: Any = spec
        for part in schema["$ref"].lstrip("#/").split("/"):
            node = node[part]
        schema = node
    return schema


JUNK = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=20),
    st.lists(st.integers(-5, 40000), max_size=5),
)


def from_schema(schema: dict[str, Any], spec: dict[str, Any], depth: int = 0) -> Any:
    """A hypothesis strategy for values of `schema`, now and then of the wrong type."""
    schema = _resolve(schema, spec)
    if depth > 4:
        return JUNK
    options = schema.get("anyOf") or schema.get("oneOf")
    if options:
        return st.one_of([from_schema(o, spec, depth + 1) for o in options])
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    if "const" in schema:
        return st.just(schema["const"])
    kind = schema.get("type")
    if kind == "object" or "properties" in schema:
        props = schema.get("properties", {})
        required = set(schema.get("required", ()))
        fields = {k: from_schema(v, spec, depth + 1) for k, v in props.items()}
        return st.fixed_dictionaries(
            {k: v for k, v in fields.items() if k in required},
            optional={k: v for k, v in fields.items() if k not in required},
        )
    if kind == "array":
        items = from_schema(schema.get("items", {}), spec, depth + 1)
        return st.lists(items, max_size=4)
    typed = {
        "string": st.text(max_size=30),
        "integer": st.integers(min_value=-(2**64), max_value=2**64),
        "number": st.floats(allow_nan=False, allow_infinity=False),
        "boolean": st.booleans(),
        "null": st.none(),
    }
    return typed.get(kind, JUNK) if isinstance(kind, str) else JUNK


def request_strategy(spec: dict[str, Any]) -> st.SearchStrategy[tuple[str, str, Any]]:
    """(method, path, body) over every route and method of `spec`."""
    choices = []
    for path, item in spec["paths"].items():
        for method, operation in item.items():
            content = operation.get("requestBody", {}).get("content", {})
            schema = content.get("application/json", {}).get("schema")
            body = JUNK if schema is None else st.one_of(from_schema(schema, spec), JUNK)
            choices.append(st.tuples(st.just(method.upper()), st.just(path), body))
    return st.one_of(choices)


FUZZ_REQUESTS = 2400


def test_schema_fuzzer(engine: vecpool.Engine) -> None:
    """Requests generated from the OpenAPI document, every route: 0 × 5xx, every refusal
    in its route's error shape, the server healthy afterwards."""
    spec = _openapi(engine)
    strategy = request_strategy(spec)
    statuses: dict[int, int] = {}
    samples = _draw(strategy, FUZZ_REQUESTS)
    routes = {path for _, path, _ in samples}
    assert len(routes) >= len(spec["paths"]) * 0.9  # nearly every route drawn

    async def scenario() -> None:
        async with serving(engine, max_batch_inputs=64) as (client, _):
            for method, path, body in samples:
                response = await client.request(method, path, json=body)
                statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
                check_answer(response)
            assert (await client.get("/health")).status_code == 200

    asyncio.run(scenario())
    print("statuses of the generated requests:", dict(sorted(statuses.items())))
    assert sum(statuses.values()) == FUZZ_REQUESTS
    assert not any(s >= 500 for s in statuses)
    assert statuses.get(200, 0) > 50, statuses  # the bodies were not all refused


def _openapi(engine: vecpool.Engine) -> dict[str, Any]:
    async def get() -> dict[str, Any]:
        async with serving(engine) as (client, _):
            return dict((await client.get("/openapi.json")).json())

    return asyncio.run(get())


def _draw(strategy: st.SearchStrategy[Any], n: int) -> list[Any]:
    """`n` examples of `strategy`, reproducibly (a fixed seed)."""
    drawn: list[Any] = []

    @settings(
        max_examples=n,
        database=None,
        derandomize=True,
        deadline=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(strategy)
    def collect(example: Any) -> None:
        drawn.append(example)

    collect()
    return drawn[:n] if len(drawn) >= n else drawn + list(_pad(drawn, n - len(drawn)))


def _pad(drawn: list[Any], k: int) -> Iterator[Any]:
    for i in range(k):
        yield drawn[i % len(drawn)]
