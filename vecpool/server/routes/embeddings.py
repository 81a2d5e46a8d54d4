"""OpenAI `POST /v1/embeddings`: one vector per input, in input order; Infinity's
`/embeddings` (its `modality: "image"` too).

A model with an image tower (CLIP, SigLIP) embeds images beside texts, in each peer's shape:
Jina's `{"image": ...}` items and `data:image/` strings in `input`, Infinity's image modality,
and vLLM's `messages` of one text or one `image_url` part.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np
from fastapi import APIRouter
from starlette.requests import Request
from starlette.responses import Response

from vecpool import calls
from vecpool.calls import EmbedOptions, PreparedCall, chat, postprocess, windowed
from vecpool.errors import InputError
from vecpool.server.codec import (
    ImageItem,
    Item,
    PartsItem,
    carries_images,
    content_item,
    decode_inputs,
    decode_prompt_embeds,
    image_sources,
    parse_inputs,
)
from vecpool.server.errors import ApiError, answered_as, infinity_error, input_code, input_error
from vecpool.server.protocol import (
    ChatFields,
    EmbeddingChatRequest,
    EmbeddingParams,
    EmbeddingRequest,
    InfinityEmbeddingRequest,
    openapi_body,
)
from vecpool.server.routes.common import (
    Timings,
    answer_vectors,
    call_context,
    read_json,
    run_call,
    validate,
)
from vecpool.server.routes.system import capabilities
from vecpool.server.state import ServerState, get_state

router = APIRouter()
T = TypeVar("T")

# Infinity's path (OpenAI's is /v1/embeddings): its refusals are Infinity's (422 for a body or
# an input it cannot take), and `dimensions` cuts any model's vectors, as Infinity cuts them.
INFINITY_EMBEDDINGS = "/embeddings"
# vLLM's refusal of a chat template sent with the request.
UNTRUSTED_TEMPLATE = (
    "Chat template is passed with request, but --trust-request-chat-template is not set. "
    "Refused request with untrusted chat template."
)


class TextInputs:
    """The inputs of a body: its `input` items (parsed and counted; with Infinity's
    `modality: "image"`, image sources), or its `messages` (vLLM's chat input: one
    conversation, rendered to one text when the call is prepared; for a model with an image
    tower, one text or one image, read without a chat template)."""

    def __init__(self, state: ServerState, body: Any):
        self.state = state
        self.chat: ChatFields | None = body if isinstance(body, ChatFields) else None
        if self.chat is not None and self.chat.chat_template is not None:
            raise ApiError(400, UNTRUSTED_TEMPLATE, param="chat_template")
        self.add_special_tokens: bool = body.add_special_tokens
        self.list_name = "input"  # the body's field the inputs' errors name
        self.items: list[Item] = []
        has_tower = state.info.image_processor_dir is not None
        self.vision_chat = self.chat is not None and state.info.vision_language
        if self.vision_chat:  # rendered by the chat template, image parts in place
            self.list_name = "messages"
        elif self.chat is not None and has_tower:
            if self.chat.continue_final_message:
                raise ApiError(
                    400,
                    "continue_final_message: a pooling model reads the whole conversation; it "
                    "continues no message",
                    param="continue_final_message",
                )
            self.items = [message_input(self.chat.messages)]
            self.chat, self.list_name = None, "messages"
            # No template writes the special tokens: the text is tokenized as `input` texts
            # are (CLIP pools its end token), unless the body says otherwise.
            if "add_special_tokens" not in body.model_fields_set:
                self.add_special_tokens = True
        elif self.chat is not None:
            refuse_image_parts(self.chat.messages)
        elif getattr(body, "modality", "text") == "image":
            if not has_tower:
                raise ApiError(
                    400,
                    f"model={body.model or state.config.model_name!r} does not support "
                    "image_embed: it has no image tower (it embeds text only; CLIP and SigLIP "
                    "models embed images)",
                    code="unsupported_by_model",
                )
            self.items = list(image_sources(body.input, "input"))
            state.check_count(len(self.items))
        else:
            self.items = parse_items(state, body.input, text_objects=has_tower)
        # read images: prepared off the event loop
        self.media = carries_images(self.items) or (
            self.vision_chat and _has_image_parts(body.messages)
        )

    def __len__(self) -> int:
        return 1 if self.chat is not None else len(self.items)

    async def run(
        self,
        request: Request,
        prepare: Callable[[calls.CallContext, list[Any]], PreparedCall[T]],
        *,
        endpoint: str | None = None,
        per_token: bool = False,
    ) -> tuple[T, Timings]:
        """`run_call` of the call `prepare` makes of these inputs (decoded as it is prepared,
        off the event loop) in their context (`call_context`): one request per input, an
        input's error naming the body's field. `endpoint`: the metrics' label (None: the
        request's path)."""
        ctx = call_context(self.state, request, self.media)
        return await run_call(
            self.state,
            request,
            endpoint or request.scope["path"],
            lambda: prepare(ctx, self.decode()),
            len(self),
            self.to_api_error,
            per_token=per_token,
            media=self.media,
        )

    def to_api_error(self, exc: InputError) -> ApiError:
        """An input's error as a 400 naming the body's field: `input[i]`, or `messages` for
        the one input a dual encoder reads from them."""
        if self.list_name == "messages" and exc.index is not None:
            reason, code = exc.reason, input_code(exc)
            return ApiError(400, f"messages: {reason}", param="messages", code=code)
        return input_error(exc)

    def decode(self) -> list[Any]:
        """The inputs for a `prepare_*` call (off the event loop: decoding, rendering)."""
        c = self.chat
        if c is None:
            return decode_inputs(self.items)
        conversation = (self.state.info.tokenizer_file, c.messages)
        rendering: dict[str, Any] = dict(
            add_generation_prompt=c.add_generation_prompt,
            continue_final_message=c.continue_final_message,
            template_kwargs=c.chat_template_kwargs,
            chat_template=self.state.info.chat_template,
        )
        if self.vision_chat:
            text, images = chat.render_chat_with_images(*conversation, **rendering)
            images = [decode_image_embeds(image) for image in images]
            return [{"prompt": text, "image": images} if images else text]
        return [chat.render_chat(*conversation, **rendering)]


def _has_image_parts(messages: list[Any]) -> bool:
    return any(
        isinstance(part, dict) and part.get("type") in ("image_url", "image", "image_embeds")
        for message in messages
        if isinstance(message, dict) and isinstance(message.get("content"), list)
        for part in message["content"]
    )


def decode_image_embeds(value: Any) -> Any:
    """An image part's value as the input stage takes it: vLLM's `image_embeds` part for
    Qwen2-VL, `{"image_embeds": "<base64 .npy or torch.save>", "image_grid_thw": [1, rows,
    columns]}`, its rows decoded (checked by the input stage); an image source as it is."""
    if not isinstance(value, dict) or "image_embeds" not in value:
        return value
    rows, grid = value["image_embeds"], value.get("image_grid_thw")
    try:
        if isinstance(rows, str):
            rows = decode_prompt_embeds(rows, 0)
    except InputError as exc:
        raise ApiError(
            400, f"messages: image_embeds: {exc.reason}", param="messages", code="invalid_input"
        ) from None
    return {"image_embeds": rows, "image_grid_thw": grid}


def message_input(messages: list[Any]) -> str | ImageItem | PartsItem:
    """vLLM's `messages` for a dual encoder (CLIP, SigLIP: vLLM's own example): one message
    whose content is one text (a string, or text parts joined by new lines) or one
    `image_url` part; read without a chat template (such folders have none)."""
    if len(messages) != 1:
        raise ApiError(
            400,
            f"messages: a model with an image tower embeds one message, one text or one "
            f"image, got {len(messages)} messages",
            param="messages",
            code="invalid_input",
        )
    (message,) = messages
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise ApiError(
            400,
            'messages[0]: a message is an object with a string "role"',
            param="messages[0]",
            code="invalid_input",
        )
    return content_item(message.get("content"), "messages[0].content")


def refuse_image_parts(messages: list[Any]) -> None:
    """A 400 naming the first `image_url` part of `messages` sent to a model without an image
    tower (the chat template reads text parts only)."""
    for i, message in enumerate(messages):
        content = message.get("content") if isinstance(message, dict) else None
        for j, part in enumerate(content if isinstance(content, list) else ()):
            if isinstance(part, dict) and part.get("type") == "image_url":
                where = f"messages[{i}].content[{j}]"
                raise ApiError(
                    400,
                    f"{where}: an image, but this model has no image tower (it embeds text "
                    "only; CLIP and SigLIP models embed images)",
                    param=where,
                    code="invalid_input",
                )


def parse_items(state: ServerState, value: Any, *, text_objects: bool = False) -> list[Item]:
    """The items of an `input` field: parsed (wire format), and counted. `text_objects`:
    Jina's `{"text": ...}` items taken (a model with an image tower)."""
    try:
        items = parse_inputs(value, text_objects=text_objects)
    except InputError as exc:
        raise input_error(exc) from None
    state.check_count(len(items))
    return items


@router.post("/v1/embeddings", openapi_extra=openapi_body(EmbeddingRequest, EmbeddingChatRequest))
# Infinity's path, and TEI's
@router.post("/embeddings", openapi_extra=openapi_body(InfinityEmbeddingRequest))
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
    infinity = request.scope["path"] == INFINITY_EMBEDDINGS
    shape = InfinityEmbeddingRequest if infinity else EmbeddingRequest
    body = validate(EmbeddingChatRequest if "messages" in data else shape, data)
    state = state.for_model(body.model)
    inputs = TextInputs(state, body)
    # vLLM and OpenAI refuse `dimensions` for a model not trained for it; Infinity cuts any.
    matryoshka_only = not infinity
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

    if options.windowed if options.windowed is not None else state.info.windowed_embed:
        array, timings = await inputs.run(
            request, lambda ctx, items: windowed.prepare_embed_windowed(ctx, items, options)
        )
        vectors = list(array)
    else:
        vectors, timings = await inputs.run(
            request, lambda ctx, items: calls.prepare_encode(ctx, items, options.encode())
        )

    if options.precision != "float32":
        stacked = postprocess.quantize(np.stack(vectors), options.precision, options.ranges)
        vectors = list(stacked)
    model = body.model or state.config.model_name
    return await answer_vectors(
        vectors, body, timings, prefix="embd", item_object="embedding", key="embedding", model=model
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
