"""OpenAI `POST /v1/embeddings`: one vector per input, in input order."""

from __future__ import annotations

from typing import Any

import numpy as np
from fastapi import APIRouter
from starlette.requests import Request
from starlette.responses import Response

from vecpool.api import PreparedCall, calls, postprocess, windowed
from vecpool.errors import InputError
from vecpool.server.codec import Item, decode_inputs, parse_inputs
from vecpool.server.errors import ApiError, input_error
from vecpool.server.protocol import EmbeddingRequest, openapi_body
from vecpool.server.routes.common import read_json, render, render_vectors, run_call, validate
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


@router.post("/v1/embeddings", openapi_extra=openapi_body(EmbeddingRequest))
@router.post("/embeddings", openapi_extra=openapi_body(EmbeddingRequest))  # TEI's, Infinity's
async def create_embeddings(request: Request) -> Response:
    state = get_state(request)
    return await embeddings(request, await read_json(request, state.config.max_payload_bytes))


async def embeddings(request: Request, data: dict[str, Any]) -> Response:
    """OpenAI embeddings of a parsed body (also reached through `/invocations`)."""
    state = get_state(request)
    body = validate(EmbeddingRequest, data)
    state = state.for_model(body.model)
    items = parse_items(state, body.input)
    ranges = quantization(state, body)
    normalize = body.normalize
    if body.use_activation is not None:
        if normalize is not None and normalize != body.use_activation:
            raise ApiError(
                400,
                f"use_activation={body.use_activation} contradicts normalize={normalize}",
                param="use_activation",
            )
        normalize = body.use_activation

    def prepare() -> PreparedCall[list[np.ndarray]]:
        return calls.prepare_encode(
            state.context,
            decode_inputs(items),
            task="embed",
            dimensions=body.dimensions,
            normalize=normalize,
            truncate_prompt_tokens=state.truncate(body),
            truncation_side=body.truncation_side,
            prompt_name=body.prompt_name,
        )

    info = state.info
    if body.windowed if body.windowed is not None else info.windowed_embed:

        def prepare_windowed() -> PreparedCall[np.ndarray]:
            return windowed.prepare_embed_windowed(
                state.context,
                decode_inputs(items),
                overlap=info.embed_window_overlap,
                default_normalize=info.embed_normalize,
                dimensions=body.dimensions,
                normalize=normalize,
                truncate_prompt_tokens=state.truncate(body),
                truncation_side=body.truncation_side,
                prompt_name=body.prompt_name,
            )

        array, timings = await run_call(
            state, request, request.url.path, prepare_windowed, len(items)
        )
        vectors = list(array)
    else:
        vectors, timings = await run_call(state, request, request.url.path, prepare, len(items))

    if body.precision != "float32":
        stacked = postprocess.quantize(np.stack(vectors), body.precision, ranges)
        vectors = list(stacked)
    return await render(
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


def quantization(state: ServerState, body: EmbeddingRequest) -> np.ndarray | None:
    """The checked ranges of a quantized call: the body's, else -1 to 1 in every dimension
    (the bounds of a unit vector's components), so that a vector's codes never depend on the
    other inputs of its request; None for float32."""
    if body.precision != "float32" and body.embed_dtype != "float32":
        raise ApiError(
            400,
            f"embed_dtype={body.embed_dtype} applies to float vectors, not to "
            f"precision={body.precision}",
            param="embed_dtype",
        )
    dim = body.dimensions or state.info.output_dim
    try:
        ranges = calls.check_quantization(body.precision, body.ranges, dim)
    except InputError as exc:
        raise input_error(exc) from None
    if ranges is None and body.precision in ("int8", "uint8"):
        return postprocess.unit_ranges(dim)
    return ranges
