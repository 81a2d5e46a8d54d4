"""`POST /pooling`: the raw output of any task the engine serves (per-token tasks: one row per
token)."""

from __future__ import annotations

import numpy as np
from fastapi import APIRouter
from starlette.requests import Request
from starlette.responses import Response

from vecpool.api import PreparedCall, calls
from vecpool.server.codec import decode_inputs
from vecpool.server.protocol import PoolingRequest
from vecpool.server.routes.common import (
    json_response,
    read_body,
    render,
    render_vectors,
    run_call,
)
from vecpool.server.routes.embeddings import parse_items
from vecpool.server.state import get_state

router = APIRouter()


@router.post("/pooling")
async def create_pooling(request: Request) -> Response:
    state = get_state(request)
    body = await read_body(request, PoolingRequest, state.config.max_payload_bytes)
    state.check_model(body.model)
    items = parse_items(state, body.input)

    def prepare() -> PreparedCall[list[np.ndarray]]:
        return calls.prepare_encode(
            state.context,
            decode_inputs(items),
            task=body.task,
            dimensions=body.dimensions,
            normalize=body.normalize,
            step_tag_id=body.step_tag_id,
            use_activation=body.use_activation,
            exclude_special_tokens=body.exclude_special_tokens,
            truncate_prompt_tokens=state.truncate(body),
            truncation_side=body.truncation_side,
            prompt_name=body.prompt_name,
        )

    vectors, timings = await run_call(state, request, "/pooling", prepare, len(items))
    content = await render(
        vectors,
        lambda: render_vectors(
            vectors,
            body,
            timings,
            prefix="pool",
            item_object="pooling",
            key="data",
            model=body.model or state.config.model_name,
        ),
    )
    return json_response(content, timings.headers())
