"""Cohere's embed API: `POST /v1/embed` and `/v2/embed`: `texts`, or for a model with an image
tower (CLIP, SigLIP) `images` (data: URIs) or `inputs` (content lists, each one text or one
image). Cohere's rerank shares `/v1/rerank` and `/v2/rerank` with Jina and vLLM (`scores.py`).

`input_type` picks the model's instruction prompt of that role (`calls.role_prompt_name`);
`embedding_types` are the vectors' float values and their quantized forms
(`postprocess.quantize`, as sentence-transformers defines them); `truncate` NONE / START / END
is no truncation, keep the end, keep the start. Refusals are Cohere's `{"id", "message"}`.
"""

from __future__ import annotations

import base64
from typing import Any

import numpy as np
from fastapi import APIRouter
from starlette.requests import Request
from starlette.responses import Response

from vecpool import calls
from vecpool.calls import EmbedOptions, postprocess
from vecpool.errors import InputError
from vecpool.server.codec import (
    ImageItem,
    PartsItem,
    content_item,
    engine_input,
    image_sources,
    to_bytes,
)
from vecpool.server.errors import ApiError, answered_as, cohere_error, input_error
from vecpool.server.protocol import CohereEmbedRequest, openapi_body
from vecpool.server.routes.common import (
    dumps,
    json_response,
    read_json,
    response_id,
    run_call_of,
    validate,
)
from vecpool.server.state import ServerState, get_state

router = APIRouter()

# Cohere's input types -> the retrieval roles of `calls.role_prompt_name`.
ROLES = {
    "search_query": "query",
    "search_document": "document",
    "classification": "classification",
    "clustering": "clustering",
}
# vecpool's parameter names -> Cohere's, in errors.
_PARAMS = {"truncate_prompt_tokens": "max_tokens", "dimensions": "output_dimension"}


@router.post("/v1/embed", openapi_extra=openapi_body(CohereEmbedRequest))
async def create_embed_v1(request: Request) -> Response:
    return await embed(request, await _read(request), version=1)


@router.post("/v2/embed", openapi_extra=openapi_body(CohereEmbedRequest))
async def create_embed_v2(request: Request) -> Response:
    return await embed(request, await _read(request), version=2)


def texts_error(exc: InputError, list_name: str = "texts") -> ApiError:
    """An input's error as a 400 whose message starts with the field it names, by Cohere's
    names (Cohere's error body has no field of its own for it): `texts[2]`, `images[0]`,
    `max_tokens`."""
    error = input_error(exc, list_name)
    param = _PARAMS.get(error.param or "", error.param)
    if param is None:
        return error
    return ApiError(400, f"{param}: {exc.reason}", param=param, code=error.code)


# Said where a model without an image tower is sent images.
_TEXT_ONLY = "this model has no image tower: it embeds texts only (CLIP and SigLIP embed images)"


@answered_as(cohere_error)
async def embed(request: Request, data: dict[str, Any], *, version: int) -> Response:
    """One embedding per text, image or input, in each of `embedding_types` (v1 without
    them: Cohere's "embeddings_floats" answer, a list of float vectors)."""
    state = get_state(request)
    body = validate(CohereEmbedRequest, data)
    state = state.for_model(body.model)
    name, items = _inputs(state, body)
    if body.truncate == "NONE" and body.max_tokens is not None:
        raise ApiError(
            400, "max_tokens cuts texts: it needs truncate START or END", param="max_tokens"
        )
    options = EmbedOptions(
        dimensions=body.output_dimension,
        truncate_prompt_tokens=None if body.truncate == "NONE" else (body.max_tokens or -1),
        truncation_side="left" if body.truncate == "START" else "right",
        prompt_name=calls.role_prompt_name(state.info, ROLES.get(body.input_type or "")),
    )

    vectors, timings = await run_call_of(
        state,
        request,
        items,
        lambda ctx: calls.prepare_encode(ctx, [engine_input(i) for i in items], options.encode()),
        lambda exc: texts_error(exc, name),
    )
    stacked = np.stack(vectors)
    billed: dict[str, int] = {"input_tokens": timings.prompt_tokens}
    num_images = sum(
        isinstance(i, ImageItem)
        or (isinstance(i, PartsItem) and any(isinstance(p, ImageItem) for p in i.parts))
        for i in items
    )
    if num_images:
        billed["images"] = num_images
    meta = {
        "api_version": {"version": str(version)},
        "billed_units": billed,
        "tokens": {"input_tokens": timings.prompt_tokens},  # as vLLM's Cohere route counts
    }
    texts = body.texts or []  # Cohere's clients read a list, empty for images
    content: dict[str, Any] = {"id": response_id("embed"), "texts": texts, "meta": meta}
    if version == 1 and body.embedding_types is None:
        content |= {"response_type": "embeddings_floats", "embeddings": stacked.tolist()}
    else:
        types = body.embedding_types or ["float"]
        embeddings = {kind: typed(stacked, kind) for kind in types}
        content |= {"response_type": "embeddings_by_type", "embeddings": embeddings}
    return json_response(dumps(content), timings.headers())


def _inputs(
    state: ServerState, body: CohereEmbedRequest
) -> tuple[str, list[str | ImageItem | PartsItem]]:
    """The field the body's inputs came in (`texts`, `images` or `inputs`: exactly one), and
    its items: texts, images, or per input one text or one image."""
    given = [n for n in ("texts", "images", "inputs") if getattr(body, n) is not None]
    if len(given) > 1:
        raise ApiError(
            400,
            f"{given[1]}: give one of texts, images and inputs, not {' and '.join(given)}",
            param=given[1],
        )
    has_tower = state.info.image_processor_dir is not None
    name = given[0] if given else "texts"
    if name != "texts" and not has_tower:
        raise ApiError(400, f"{name}: {_TEXT_ONLY}; send texts", param=name)
    if name == "texts" and body.input_type == "image":
        what = "send the images in images" if has_tower else _TEXT_ONLY
        raise ApiError(400, f"input_type image is for images: {what}", param="input_type")
    items: list[str | ImageItem | PartsItem]
    if name == "texts":
        if not body.texts:
            raise ApiError(
                400, "texts: give at least one text", param="texts", code="invalid_input"
            )
        items = list(body.texts)
    elif name == "images":
        items = list(image_sources(body.images, "images"))
    else:
        assert body.inputs is not None
        together = state.info.vision_language  # text and images read as one input
        items = [
            content_item(i.content, f"inputs[{j}].content", together=together)
            for j, i in enumerate(body.inputs)
        ]
    state.check_count(len(items), name)
    return name, items


def typed(vectors: np.ndarray, kind: str) -> Any:
    """Cohere's embedding type `kind` of `[n, dim]` float vectors: float lists; int8 / uint8
    calibrated on -1 to 1 (a unit vector's range, so a text's codes do not depend on the rest
    of its request); binary / ubinary packed bits; base64 of little-endian float32 bytes."""
    if kind == "float":
        return vectors.tolist()
    if kind == "base64":
        return [base64.b64encode(to_bytes(v, "float32", "little")).decode("ascii") for v in vectors]
    ranges = postprocess.unit_ranges(vectors.shape[1]) if kind.endswith("int8") else None
    return postprocess.quantize(vectors, kind, ranges).tolist()


@answered_as(cohere_error)
async def _read(request: Request) -> dict[str, Any]:
    return await read_json(request, get_state(request).config.max_payload_bytes)
