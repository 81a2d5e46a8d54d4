"""`POST /pooling`: the raw output of any task the engine serves (per-token tasks: one row per
token)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from starlette.requests import Request
from starlette.responses import Response

from vecpool import calls
from vecpool.calls import EncodeOptions
from vecpool.server.protocol import PoolingChatRequest, PoolingRequest, openapi_body
from vecpool.server.routes.common import PER_TOKEN, answer_vectors, read_json, validate
from vecpool.server.routes.embeddings import TextInputs
from vecpool.server.state import get_state

router = APIRouter()


@router.post("/pooling", openapi_extra=openapi_body(PoolingRequest, PoolingChatRequest))
async def create_pooling(request: Request) -> Response:
    state = get_state(request)
    return await pooling(request, await read_json(request, state.config.max_payload_bytes))


async def pooling(request: Request, data: dict[str, Any]) -> Response:
    """Any task's raw output for a parsed body (also reached through `/invocations`)."""
    state = get_state(request)
    body = validate(PoolingChatRequest if "messages" in data else PoolingRequest, data)
    state = state.for_model(body.model)
    inputs = TextInputs(state, body)
    # The body's fields are vLLM's names for the options (task, dimensions, normalize,
    # step_tag_id, use_activation, exclude_special_tokens, the truncation, prompt_name,
    # add_special_tokens): each is read by its name.
    options = EncodeOptions.of(
        {
            **dict(body),
            "truncate_prompt_tokens": state.truncate(body),
            "add_special_tokens": inputs.add_special_tokens,  # chat's default is the inputs'
            "matryoshka_only": True,  # vLLM's rule for `dimensions`
        }
    )

    vectors, timings = await inputs.run(
        request,
        lambda ctx, items: calls.prepare_encode(ctx, items, options),
        endpoint="/pooling",
        per_token=options.task in PER_TOKEN,
    )
    model = body.model or state.config.model_name
    return await answer_vectors(
        vectors, body, timings, prefix="pool", item_object="pooling", key="data", model=model
    )
