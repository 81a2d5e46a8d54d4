"""OpenAI `POST /v1/embeddings`: one vector per input, in input order."""

from __future__ import annotations

from typing import Any

import numpy as np
from fastapi import APIRouter
from starlette.requests import Request
from starlette.responses import Response

from vecpool import calls
from vecpool.calls import EmbedOptions, PreparedCall, chat, postprocess, windowed
from vecpool.errors import InputError
from vecpool.server.codec import Item, decode_inputs, parse_inputs
from vecpool.server.errors import ApiError, answered_as, infinity_error, input_error
from vecpool.server.protocol import (
    ChatFields,
    EmbeddingChatRequest,
    EmbeddingParams,
    EmbeddingRequest,
    openapi_body,
)
from vecpool.server.routes.common import read_json, render, render_vectors, run_call, validate
from vecpool.server.routes.system import capabilities
from vecpool.server.state import ServerState, get_state

router = APIRouter()

# Infinity's path (OpenAI's is /v1/embeddings): its refusals are Infinity's (422 for a body or
# an input it cannot take), and `dimensions` cuts any model's vectors, as Infinity cuts them.
INFINITY_EMBEDDINGS = "/embeddings"
# vLLM's refusal of a chat template sent with the request.
UNTRUSTED_TEMPLATE = (
    "Chat template is passed with request, but --trust-request-chat-template is not set. "
    "Refused request with untrusted chat template."
)


class TextInputs:
    """The inputs of a body: its `input` items (parsed and counted), or its `messages`
    (vLLM's chat input: one conversation, rendered to one text when the call is prepared)."""

    def __init__(self, state: ServerState, body: Any):
        self.state = state
        self.chat: ChatFields | None = body if isinstance(body, ChatFields) else None
        if self.chat is not None and self.chat.chat_template is not None:
            raise ApiError(400, UNTRUSTED_TEMPLATE, param="chat_template")
        self.items = [] if self.chat is not None else parse_items(state, body.input)
        self.add_special_tokens: bool = body.add_special_tokens

    def __len__(self) -> int:
        return 1 if self.chat is not None else len(self.items)

    def decode(self) -> list[Any]:
        """The inputs for a `prepare_*` call (off the event loop: decoding, rendering)."""
        if self.chat is None:
            return decode_inputs(self.items)
        return [
            chat.render_chat(
                self.state.info.tokenizer_file,
                self.chat.messages,
                add_generation_prompt=self.chat.add_generation_prompt,
                continue_final_message=self.chat.continue_final_message,
                template_kwargs=self.chat.chat_template_kwargs,
            )
        ]


def parse_items(state: ServerState, value: Any) -> list[Item]:
    """The items of an `input` field: parsed (wire format), and counted."""
    try:
        items = parse_inputs(value)
    except InputError as exc:
        raise input_error(exc) from None
    state.check_count(len(items))
    return items


@router.post("/v1/embeddings", openapi_extra=openapi_body(EmbeddingRequest, EmbeddingChatRequest))
@router.post("/embeddings", openapi_extra=openapi_body(EmbeddingRequest))  # Infinity's, TEI's
async def create_embeddings(request: Request) -> Response:
    state = get_state(request)
    if request.scope["path"] == INFINITY_EMBEDDINGS:
        return await infinity_embeddings(request)
    return await embeddings(request, await read_json(request, state.config.max_payload_bytes))


@answered_as(infinity_error)
async def infinity_embeddings(request: Request) -> Response:
    """Infinity's embeddings: only for a model it would embed with (not a reranker or a
    classifier, whose pooled states are no embedding)."""
    state = get_state(request)
    data = await read_json(request, state.config.max_payload_bytes)
    model = data.get("model") if isinstance(data, dict) else None
    served = state.for_model(model if isinstance(model, str) else None)
    if "embed" not in capabilities(served.info):
        raise ApiError(
            400,
            f"model={model or served.config.model_name!r} does not support embed: "
            f"it is for {', '.join(capabilities(served.info)) or 'no Infinity route'}",
            code="unsupported_by_model",
        )
    return await embeddings(request, data)


async def embeddings(request: Request, data: dict[str, Any]) -> Response:
    """OpenAI embeddings of a parsed body (also reached through `/invocations`); with
    `messages`, vLLM's embedding of one conversation."""
    state = get_state(request)
    body = validate(EmbeddingChatRequest if "messages" in data else EmbeddingRequest, data)
    state = state.for_model(body.model)
    inputs = TextInputs(state, body)
    # vLLM and OpenAI refuse `dimensions` for a model not trained for it; Infinity cuts any.
    matryoshka_only = request.scope["path"] != INFINITY_EMBEDDINGS
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

    options = EmbedOptions(
        dimensions=body.dimensions,
        normalize=normalize,
        truncate_prompt_tokens=state.truncate(body),
        truncation_side=body.truncation_side,
        prompt_name=body.prompt_name,
        precision=body.precision,
        ranges=ranges,
        windowed=body.windowed,
        add_special_tokens=inputs.add_special_tokens,
        matryoshka_only=matryoshka_only,
    )

    def prepare() -> PreparedCall[list[np.ndarray]]:
        return calls.prepare_encode(state.context, inputs.decode(), options.encode())

    info = state.info
    if options.windowed if options.windowed is not None else info.windowed_embed:

        def prepare_windowed() -> PreparedCall[np.ndarray]:
            return windowed.prepare_embed_windowed(state.context, inputs.decode(), options)

        array, timings = await run_call(
            state, request, request.scope["path"], prepare_windowed, len(inputs)
        )
        vectors = list(array)
    else:
        vectors, timings = await run_call(
            state, request, request.scope["path"], prepare, len(inputs)
        )

    if options.precision != "float32":
        stacked = postprocess.quantize(np.stack(vectors), options.precision, options.ranges)
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


def quantization(state: ServerState, body: EmbeddingParams) -> np.ndarray | None:
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
    try:
        calls.check_dimensions(state.info, body.dimensions)  # before it sizes the ranges
        dim = state.info.embed_dim(body.dimensions)
        ranges = calls.check_quantization(body.precision, body.ranges, dim)
    except InputError as exc:
        raise input_error(exc) from None
    if ranges is None and body.precision in ("int8", "uint8"):
        return postprocess.unit_ranges(dim)
    return ranges
