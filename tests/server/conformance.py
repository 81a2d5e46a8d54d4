"""What the conformance modules share: one request to an engine served in this process (the
app in-process through ASGI: no sockets, milliseconds a request).

Each conformance module holds a peer's documented expectations, one test each, named after
the peer and the behaviour, with the document it comes from; an expectation vecpool does not
meet by choice or because two peers conflict is `xfail(strict=True)` with the reason, and the
server README lists it.
"""

from __future__ import annotations

import asyncio
from typing import Any

import httpx

import vecpool
from tests.server.asgi import NAME, serving

MODEL = NAME  # the served name in these tests


def ask(engine: vecpool.Engine, path: str, body: Any = None, **config: Any) -> httpx.Response:
    """POST `body` (GET without one) to `path` of `engine` served with `config`."""

    async def send() -> httpx.Response:
        async with serving(engine, **config) as (client, _):
            if body is None:
                return await client.get(path)
            return await client.post(path, json=body)

    return asyncio.run(send())


def error_message(response: httpx.Response) -> str:
    """The message of an error body, OpenAI's `{"error": {"message"}}` or a peer's."""
    body = response.json()
    if isinstance(body.get("error"), dict):
        return str(body["error"]["message"])
    return str(body.get("message") or body.get("error"))
