"""OpenAI `POST /v1/embeddings`: one vector per input, in input order."""

from __future__ import annotations

from typing import Any

import numpy as np
from fastapi import APIRouter
from starlette.requests import Request
from starlette.responses import Response

from vecpool.api import PreparedCall, calls
from vecpool.errors import InputError
from vecpool.server.codec import Item, decode_inputs, parse_inputs
from vecpool.server.errors import input_error
from vecpool.server.protocol import EmbeddingRequest
from vecpool.server.routes.common import (
    json_response,
    read_body,
    render,
    render_vectors,
    run_call,
)
from vecpool.server.state import ServerState, get_state

router = APIRouter()


def parse_items(state: ServerState, value: Any) -> list[Item]:
    """The items of an `input` field: parsed (wire format), and counted."""
    try:
        items = parse_inputs(value)
    except InputError as exc:
        raise input_error(exc) from None
    state.check_count(len(items))
    return items


@router.post("/v1/embeddings")
async def create_embeddings(request: Request) -> Response:
    state = get_state(request)
    body = await read_body(request, EmbeddingRequest, state.config.max_payload_bytes)
    state.check_model(body.model)
    items = parse_items(state, body.input)

    def prepare() -> PreparedCall[list[np.ndarray]]:
        return calls.prepare_encode(
            state.context,
            decode_inputs(items),
            task="embed",
            dimensions=body.dimensions,
            normalize=body.normalize,
            truncate_prompt_tokens=state.truncate(body),
            truncation_side=body.truncation_side,
            prompt_name=body.prompt_name,
        )

    vectors, timings = await run_call(state, request, "/v1/embeddings", prepare, len(items))
    content = await render(
        vectors,
        lambda: render_vectors(
            vectors,
            body,
            timings,
            prefix="embd",
            item_object="embedding",
            key="embedding",
            model=body.model or state.config.model_name,
        ),
    )
    return json_response(content, timings.headers())
