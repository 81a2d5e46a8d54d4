"""Endpoints over the pooling engine: embeddings, pooling, tokenize, models, health, metrics."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import Callable
from typing import Any

import numpy as np
from fastapi import APIRouter
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.requests import Request
from starlette.responses import Response

from vecpool.api import PreparedCall
from vecpool.errors import InputError
from vecpool.server.codec import decode_inputs, encode_array, parse_inputs
from vecpool.server.errors import ApiError, input_error
from vecpool.server.protocol import (
    DetokenizeRequest,
    EmbeddingRequest,
    OutputParams,
    PoolingRequest,
    TokenizeRequest,
)
from vecpool.server.serving import (
    ServerState,
    Timings,
    check_count,
    check_embeds_allowed,
    get_state,
    read_body,
    run_call,
)
from vecpool.tasks import TASKS, get_task

router = APIRouter()


def json_response(content: bytes, headers: dict[str, str] | None = None) -> Response:
    return Response(content, media_type="application/json", headers=headers)


def dumps(body: dict[str, Any]) -> bytes:
    return json.dumps(body, allow_nan=False, separators=(",", ":")).encode()


def _usage(timings: Timings) -> dict[str, int]:
    return {"prompt_tokens": timings.prompt_tokens, "total_tokens": timings.prompt_tokens}


def _render_vectors(
    vectors: list[np.ndarray],
    body: OutputParams,
    timings: Timings,
    *,
    prefix: str,
    item_object: str,
    key: str,
    model: str,
) -> bytes:
    data = []
    for index, vector in enumerate(vectors):
        item: dict[str, Any] = {
            "object": item_object,
            "index": index,
            key: encode_array(vector, body.encoding_format, body.embed_dtype),
        }
        if body.encoding_format == "base64" and vector.ndim > 1:
            item["shape"] = list(vector.shape)
        data.append(item)
    return dumps(
        {
            "id": f"{prefix}-{uuid.uuid4().hex}",
            "object": "list",
            "created": int(time.time()),
            "model": model,
            "data": data,
            "usage": _usage(timings),
        }
    )


def _prepare_vectors(
    state: ServerState, body: OutputParams, items: list[Any], task: str, **params: Any
) -> Callable[[], PreparedCall[list[np.ndarray]]]:
    def prepare() -> PreparedCall[list[np.ndarray]]:
        return state.engine.prepare_encode(
            decode_inputs(items),
            task=task,
            dimensions=body.dimensions,
            normalize=body.normalize,
            truncate_prompt_tokens=state.truncate(body),
            truncation_side=body.truncation_side,
            prompt_name=body.prompt_name,
            **params,
        )

    return prepare


def _items(state: ServerState, value: Any) -> list[Any]:
    try:
        items = parse_inputs(value)
    except InputError as exc:
        raise input_error(exc) from None
    check_count(state, len(items))
    check_embeds_allowed(state, items)
    return items


@router.post("/v1/embeddings")
async def create_embeddings(request: Request) -> Response:
    """OpenAI embeddings: one vector per input, in input order."""
    state = get_state(request)
    body = await read_body(request, EmbeddingRequest, state.config.max_payload_bytes)
    state.check_model(body.model)
    items = _items(state, body.input)
    prepare = _prepare_vectors(state, body, items, "embed")
    vectors, timings = await run_call(state, request, "/v1/embeddings", prepare, len(items))
    content = await asyncio.to_thread(
        _render_vectors,
        vectors,
        body,
        timings,
        prefix="embd",
        item_object="embedding",
        key="embedding",
        model=body.model or state.config.model_name,
    )
    return json_response(content, timings.headers())


@router.post("/pooling")
async def create_pooling(request: Request) -> Response:
    """The raw output of any task the engine declares (per-token tasks: one row per token)."""
    state = get_state(request)
    body = await read_body(request, PoolingRequest, state.config.max_payload_bytes)
    state.check_model(body.model)
    try:
        get_task(body.task)
    except InputError as exc:
        raise input_error(exc) from None
    items = _items(state, body.input)
    prepare = _prepare_vectors(
        state,
        body,
        items,
        body.task,
        step_tag_id=body.step_tag_id,
        use_activation=body.use_activation,
        exclude_special_tokens=body.exclude_special_tokens,
    )
    vectors, timings = await run_call(state, request, "/pooling", prepare, len(items))
    content = await asyncio.to_thread(
        _render_vectors,
        vectors,
        body,
        timings,
        prefix="pool",
        item_object="pooling",
        key="data",
        model=body.model or state.config.model_name,
    )
    return json_response(content, timings.headers())


@router.post("/tokenize")
async def tokenize(request: Request) -> Response:
    """The token ids a text becomes (special tokens and instruction prompt included)."""
    state = get_state(request)
    body = await read_body(request, TokenizeRequest, state.config.max_payload_bytes)
    state.check_model(body.model)
    engine = state.engine
    try:
        tokens = await asyncio.to_thread(engine.tokenize, body.prompt, prompt_name=body.prompt_name)
    except InputError as exc:
        raise input_error(exc, "prompt") from None
    body_out = {"count": len(tokens), "max_model_len": engine.max_model_len, "tokens": tokens}
    return json_response(dumps(body_out))


@router.post("/detokenize")
async def detokenize(request: Request) -> Response:
    """The text of token ids (special tokens skipped)."""
    state = get_state(request)
    body = await read_body(request, DetokenizeRequest, state.config.max_payload_bytes)
    state.check_model(body.model)
    tokenizer = state.engine.tokenizer
    if tokenizer is None:
        raise ApiError(400, "the model folder has no tokenizer.json", code="no_tokenizer")
    vocab_size = state.engine.inputs.limits.vocab_size
    for i, token in enumerate(body.tokens):
        if not 0 <= token < vocab_size:
            raise ApiError(
                400,
                f"tokens[{i}]: token id {token} is outside the vocabulary [0, {vocab_size})",
                param=f"tokens[{i}]",
                code="invalid_input",
            )
    text = await asyncio.to_thread(tokenizer.decode, body.tokens)
    return json_response(dumps({"prompt": text}))


@router.get("/v1/models")
async def list_models(request: Request) -> Response:
    state = get_state(request)
    engine = state.engine
    missing = engine.missing_heads  # heads the checkpoint lacks: tasks it cannot serve
    models = [
        {
            "id": name,
            "object": "model",
            "created": state.created,
            "owned_by": "vecpool",
            "max_model_len": engine.max_model_len,
            "hidden_size": engine.hidden_size,
            "output_dim": engine.output_dim,
            "tasks": [t for t, spec in sorted(TASKS.items()) if spec.head not in missing],
            "score_mode": engine.score_mode,  # how /score and /rerank compare texts
        }
        for name in state.config.model_names
    ]
    return json_response(dumps({"object": "list", "data": models}))


@router.get("/health")
async def health(request: Request) -> Response:
    """200 while the engine loop runs, 503 otherwise."""
    get_state(request).running_front()
    return json_response(dumps({"status": "ok"}))


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    return Response(get_state(request).metrics.render(), media_type=CONTENT_TYPE_LATEST)
