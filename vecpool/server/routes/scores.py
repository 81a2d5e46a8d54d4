"""Scores over pairs and classes: rerank (Cohere and Jina shapes), score, classify.

Each route prepares its call (`calls.prepare_rerank` / `prepare_score` / `prepare_classify`)
and runs it like any other (queue, cancellation on disconnect, timings); the rules of pairing
and ranking are the api layer's, and this file only maps its errors onto the request's fields.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import numpy as np
from fastapi import APIRouter
from starlette.requests import Request
from starlette.responses import Response

from vecpool.api import PreparedCall, calls
from vecpool.errors import InputError
from vecpool.server.codec import decode_inputs
from vecpool.server.errors import ApiError, input_error
from vecpool.server.protocol import ClassifyRequest, RerankRequest, ScoreRequest
from vecpool.server.routes.common import dumps, json_response, read_body, response_id, run_call
from vecpool.server.routes.embeddings import parse_items
from vecpool.server.state import get_state

router = APIRouter()


def _pair_error(first: str, second: str) -> Callable[[InputError], ApiError]:
    """Maps an engine error about a (first, second) pair to the request's field names: the
    engine calls the sides text_1 / text_2 (or text / text_pair), and indexes the pairs."""

    def to_api_error(exc: InputError) -> ApiError:
        if exc.field in ("text_1", "text"):
            param = first if first == "query" or exc.index is None else f"{first}[{exc.index}]"
        elif exc.field in ("text_2", "text_pair") or (exc.field is None and exc.index is not None):
            param = second if exc.index is None else f"{second}[{exc.index}]"
        else:
            return input_error(exc)
        return ApiError(400, str(exc), param=param, code="invalid_input")

    return to_api_error


@router.post("/rerank")
@router.post("/v1/rerank")
@router.post("/v2/rerank")
async def rerank(request: Request) -> Response:
    """Documents ranked by relevance to the query, best first (Cohere and Jina shapes)."""
    state = get_state(request)
    body = await read_body(request, RerankRequest, state.config.max_payload_bytes)
    state.check_model(body.model)
    state.check_count(len(body.documents), "documents")
    texts = [d if isinstance(d, str) else d.text for d in body.documents]

    def prepare() -> PreparedCall[list[tuple[int, float]]]:
        return calls.prepare_rerank(
            state.context,
            body.query,
            texts,
            body.top_n,
            truncate_prompt_tokens=state.truncate(body),
            truncation_side=body.truncation_side,
        )

    ranked, timings = await run_call(
        state, request, request.url.path, prepare, len(texts) + 1, _pair_error("query", "documents")
    )
    results = []
    for index, score in ranked:
        item: dict[str, Any] = {"index": index, "relevance_score": score}
        if body.return_documents:
            item["document"] = {"text": texts[index]}
        results.append(item)
    content = {
        "id": response_id("rerank"),
        "model": body.model or state.config.model_name,
        "results": results,
        "usage": {"total_tokens": timings.prompt_tokens},
        "meta": {"billed_units": {"search_units": 1}},
    }
    return json_response(dumps(content), timings.headers())


@router.post("/score")
async def score(request: Request) -> Response:
    """`text_1` scored against each `text_2` (or pairwise, for two lists of one length)."""
    state = get_state(request)
    body = await read_body(request, ScoreRequest, state.config.max_payload_bytes)
    state.check_model(body.model)
    first = [body.text_1] if isinstance(body.text_1, str) else body.text_1
    second = [body.text_2] if isinstance(body.text_2, str) else body.text_2
    state.check_count(len(first), "text_1")
    state.check_count(len(second), "text_2")

    def prepare() -> PreparedCall[np.ndarray]:
        return calls.prepare_score(
            state.context,
            first,
            second,
            use_activation=body.use_activation,
            truncate_prompt_tokens=state.truncate(body),
            truncation_side=body.truncation_side,
        )

    scores, timings = await run_call(
        state, request, "/score", prepare, len(first) + len(second), _pair_error("text_1", "text_2")
    )
    data = [
        {"index": i, "object": "score", "score": np.asarray(s).tolist()}
        for i, s in enumerate(scores)
    ]
    content = {
        "id": response_id("score"),
        "object": "list",
        "created": int(time.time()),
        "model": body.model or state.config.model_name,
        "data": data,
        "usage": timings.usage(),
    }
    return json_response(dumps(content), timings.headers())


@router.post("/classify")
async def classify(request: Request) -> Response:
    """Class probabilities (raw logits with use_activation=false) per input."""
    state = get_state(request)
    body = await read_body(request, ClassifyRequest, state.config.max_payload_bytes)
    state.check_model(body.model)
    items = parse_items(state, body.input)

    def prepare() -> PreparedCall[np.ndarray]:
        return calls.prepare_classify(
            state.context,
            decode_inputs(items),
            use_activation=body.use_activation,
            truncate_prompt_tokens=state.truncate(body),
            truncation_side=body.truncation_side,
        )

    probs, timings = await run_call(state, request, "/classify", prepare, len(items))
    rendered = await asyncio.to_thread(_classes, probs, state.info.id2label)
    content = {
        "id": response_id("classify"),
        "object": "list",
        "created": int(time.time()),
        "model": body.model or state.config.model_name,
        "data": rendered,
        "usage": timings.usage(),
    }
    return json_response(dumps(content), timings.headers())


def _classes(probs: np.ndarray, id2label: dict[int, str]) -> list[dict[str, Any]]:
    data = []
    for i, row in enumerate(probs):
        best = int(np.argmax(row))
        data.append(
            {
                "index": i,
                "object": "classification",
                "label": id2label.get(best, f"LABEL_{best}"),
                "probs": row.tolist(),
                "num_classes": int(row.shape[0]),
            }
        )
    return data
