"""Scores over pairs and classes: rerank (Cohere, Jina, vLLM, Infinity and Text Embeddings
Inference shapes), score (vLLM's four pairs of names), classify.

Each route prepares its call (`calls.prepare_rerank` / `prepare_score` / `prepare_classify`)
and runs it like any other (queue, cancellation on disconnect, timings); the rules of pairing
and ranking are the api layer's, whose errors name the side at fault ("query" or "documents"
of rerank, "text_1" or "text_2" of score): this file only renames those to the request's
fields.

A model that scores by embeddings and has an image tower (CLIP, SigLIP: the cosine of a text's
and an image's vectors in the shared space) ranks images too, in the shapes that have a form
for them: Jina's `{"image": ...}` documents, and vLLM's `{"content": [parts]}` items on either
side of rerank and score. Infinity's and TEI's rerank bodies have none (texts only).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import numpy as np
from fastapi import APIRouter
from starlette.requests import Request
from starlette.responses import Response

from vecpool import calls
from vecpool.calls import ClassifyOptions, PreparedCall, RerankOptions, ScoreOptions
from vecpool.server.codec import ImageItem, PartsItem, content_item, engine_input
from vecpool.server.errors import ApiError, answered_as, infinity_error, side_errors
from vecpool.server.protocol import (
    SCORE_SHAPES,
    ClassifyChatRequest,
    ClassifyRequest,
    ContentInput,
    ImageDocument,
    InfinityClassifyRequest,
    InfinityRerankRequest,
    RerankDocument,
    RerankRequest,
    ScoreParams,
    TeiRerankRequest,
    openapi_body,
)
from vecpool.server.routes import tei as tei_routes
from vecpool.server.routes.common import (
    Timings,
    dumps,
    json_response,
    list_answer,
    read_json,
    response_id,
    run_call_of,
    validate,
)
from vecpool.server.routes.embeddings import TextInputs
from vecpool.server.state import get_state

router = APIRouter()


RERANK_ERRORS = side_errors({"query": "query", "documents": "documents"}, {"query": False})


@router.post(
    "/rerank", openapi_extra=openapi_body(RerankRequest, TeiRerankRequest, InfinityRerankRequest)
)
@router.post("/v1/rerank", openapi_extra=openapi_body(RerankRequest))
@router.post("/v2/rerank", openapi_extra=openapi_body(RerankRequest))
async def create_rerank(request: Request) -> Response:
    """Documents ranked by relevance to the query, best first. A body with `texts` is Text
    Embeddings Inference's and gets its answer; with `documents`, Cohere's, Jina's, vLLM's."""
    state = get_state(request)
    return await rerank_any(request, await read_json(request, state.config.max_payload_bytes))


def is_tei_rerank(data: dict[str, Any]) -> bool:
    """Whether a rerank body is TEI's: `texts` instead of `documents`."""
    return "texts" in data and "documents" not in data


async def rerank_any(request: Request, data: dict[str, Any]) -> Response:
    """A rerank body of any shape: `texts` (TEI), `raw_scores` on `/rerank` (Infinity, whose
    client always sends it), else `documents` (Cohere, Jina, vLLM)."""
    if is_tei_rerank(data):
        return await tei_routes.rerank(request, data)
    if "raw_scores" in data and request.scope["path"] == "/rerank":
        return await infinity_rerank(request, data)
    return await rerank(request, data)


@answered_as(infinity_error)
async def infinity_rerank(request: Request, data: dict[str, Any]) -> Response:
    """Infinity's rerank: `top_n` above 0, documents strings, `document` a string in the
    answer (with `return_documents`), refusals as Infinity's (422 for what it cannot take)."""
    state = get_state(request)
    body = validate(InfinityRerankRequest, data)
    state = state.for_model(body.model)
    state.check_count(len(body.documents), "documents")

    def prepare(ctx: calls.CallContext) -> PreparedCall[list[tuple[int, float]]]:
        options = RerankOptions(  # built here: its checks answer as the call's errors
            top_n=body.top_n,
            use_activation=activation(None, body.raw_scores),
            truncate_prompt_tokens=state.truncate(),  # Infinity's bodies: --auto-truncate decides
        )
        return calls.prepare_rerank(ctx, body.query, body.documents, options=options)

    # a data:image/ string is an image
    inputs = [body.query, *body.documents]
    ranked, timings = await run_call_of(state, request, inputs, prepare, RERANK_ERRORS)
    results = [
        {
            "relevance_score": score,
            "index": index,
            "document": body.documents[index] if body.return_documents else None,
        }
        for index, score in ranked
    ]
    return infinity_answer(
        "rerank", "results", results, body.model or state.config.model_name, timings
    )


async def rerank(request: Request, data: dict[str, Any]) -> Response:
    state = get_state(request)
    body = validate(RerankRequest, data)
    state = state.for_model(body.model)
    state.check_count(len(body.documents), "documents")
    if body.rank_fields not in (None, ["text"]):
        raise ApiError(
            400,
            f"rank_fields={body.rank_fields}: documents are ranked by their text only",
            param="rank_fields",
        )
    if body.max_chunks_per_doc is not None:
        raise ApiError(
            400,
            "max_chunks_per_doc: vecpool does not chunk documents; use max_tokens_per_doc or "
            "truncate_prompt_tokens to cut long documents",
            param="max_chunks_per_doc",
        )
    use_activation = activation(body.use_activation, body.raw_scores)
    together = state.info.vision_language  # text and image parts read as one input
    query = score_item(body.query, "query", together)
    documents = [rerank_document(d, i, together) for i, d in enumerate(body.documents)]
    if body.return_documents:
        _check_echoed(body.documents)

    def prepare(ctx: calls.CallContext) -> PreparedCall[list[tuple[int, float]]]:
        options = RerankOptions(  # built here: its checks answer as the call's errors
            top_n=body.top_n,
            use_activation=use_activation,
            max_tokens_per_doc=body.max_tokens_per_doc,
            truncate_prompt_tokens=state.truncate(body),
            truncation_side=body.truncation_side,
        )
        inputs = [engine_input(d) for d in documents]
        return calls.prepare_rerank(ctx, engine_input(query), inputs, options=options)

    ranked, timings = await run_call_of(state, request, [query, *documents], prepare, RERANK_ERRORS)
    results = []
    for index, score in ranked:
        item: dict[str, Any] = {"index": index, "relevance_score": score}
        if body.return_documents:
            document = body.documents[index]
            item["document"] = (
                {"text": document} if isinstance(document, str) else document.model_dump()
            )
        results.append(item)
    content = {
        "id": response_id("rerank"),
        "model": body.model or state.config.model_name,
        "results": results,
        "usage": timings.usage(),
        "meta": {
            "billed_units": {"search_units": 1},
            "tokens": {"input_tokens": timings.prompt_tokens},
        },
    }
    return json_response(dumps(content), timings.headers())


def rerank_document(
    document: str | RerankDocument | ImageDocument | ContentInput,
    index: int,
    together: bool = False,
) -> str | ImageItem | PartsItem:
    """A rerank document as an input: a string or `{"text", ...}` a text, Jina's
    `{"image", ...}` an image, vLLM's `{"content": [parts]}` one text or one image (or, with
    `together`, a vision-language model's, text and images together)."""
    if isinstance(document, RerankDocument):
        if document.model_extra and "image" in document.model_extra:
            where = f"documents[{index}]"
            raise ApiError(
                400,
                f"{where}: a document is a text or an image, not both ('text' and 'image')",
                param=where,
            )
        return document.text
    if isinstance(document, ImageDocument):
        return ImageItem(document.image)
    return score_item(document, f"documents[{index}]", together)


def score_item(
    item: str | ContentInput, where: str, together: bool = False
) -> str | ImageItem | PartsItem:
    """A text, or vLLM's `{"content": [parts]}` item (one text or one image; with `together`,
    text and images together)."""
    if isinstance(item, str):
        return item
    return content_item(item.content, f"{where}.content", together=together)


def _check_echoed(documents: list[str | RerankDocument | ImageDocument | ContentInput]) -> None:
    """A 400 naming the first field of a document object that its answer could not return:
    one with a lone surrogate (JSON's escapes let a body carry one; UTF-8 cannot). Its text
    is the engine's to refuse, as any input's."""
    for index, document in enumerate(documents):
        if isinstance(document, str) or not document.model_extra:
            continue
        for key, value in document.model_extra.items():
            try:
                dumps({key: value})
            except UnicodeEncodeError:
                name = key.encode("utf-8", "backslashreplace").decode("utf-8")
                param = f"documents[{index}].{name}"
                raise ApiError(
                    400,
                    f"{param}: not valid Unicode (a lone surrogate): the answer returns the "
                    "document's fields as given; fix the field or send return_documents false",
                    param=param,
                ) from None


def activation(use_activation: bool | None, raw_scores: bool | None) -> bool | None:
    """`use_activation` from it or its other name, `raw_scores` (true: no activation; false:
    the model's own scores, as when left out: Infinity's client always sends it, and a model
    that ranks by cosine, with no activation to apply, takes it)."""
    if raw_scores is None:
        return use_activation
    if use_activation is not None and use_activation == raw_scores:
        raise ApiError(
            400,
            f"use_activation={use_activation} contradicts raw_scores={raw_scores}",
            param="raw_scores",
        )
    return False if raw_scores else use_activation


@router.post("/score", openapi_extra=openapi_body(*(shape for shape, _, _ in SCORE_SHAPES)))
@router.post("/v1/score", openapi_extra=openapi_body(*(shape for shape, _, _ in SCORE_SHAPES)))
async def create_score(request: Request) -> Response:
    """The first side scored against each of the second (or pairwise for two equal lists).
    Its sides are named `text_1` / `text_2`, `data_1` / `data_2`, `queries` / `documents` or
    `queries` / `items` (vLLM's names); errors name the request's fields."""
    state = get_state(request)
    return await score(request, await read_json(request, state.config.max_payload_bytes))


def score_shape(data: dict[str, Any]) -> tuple[type[ScoreParams], str, str]:
    """The shape of a score body, from its keys (that of text_1 / text_2 when none fits)."""
    for shape in SCORE_SHAPES:
        _, first, second = shape
        if first in data and second in data:
            return shape
    for shape in SCORE_SHAPES:
        if shape[1] in data or shape[2] in data:
            return shape
    return SCORE_SHAPES[0]


async def score(request: Request, data: dict[str, Any]) -> Response:
    state = get_state(request)
    model, first_name, second_name = score_shape(data)
    body = validate(model, data)
    state = state.for_model(body.model)
    first, second = getattr(body, first_name), getattr(body, second_name)
    together = state.info.vision_language
    firsts = score_side(first, first_name, together)
    seconds = score_side(second, second_name, together)
    state.check_count(len(firsts), first_name)
    state.check_count(len(seconds), second_name)
    options = ScoreOptions(
        use_activation=body.use_activation,
        truncate_prompt_tokens=state.truncate(body),
        truncation_side=body.truncation_side,
        one_score=True,
    )

    def prepare(ctx: calls.CallContext) -> PreparedCall[np.ndarray]:
        lefts, rights = [engine_input(a) for a in firsts], [engine_input(b) for b in seconds]
        return calls.prepare_score(ctx, lefts, rights, options)

    to_api_error = side_errors(
        {"text_1": first_name, "text_2": second_name},
        {"text_1": isinstance(first, list), "text_2": isinstance(second, list)},
    )
    scores, timings = await run_call_of(state, request, firsts + seconds, prepare, to_api_error)
    rows = [{"index": i, "object": "score", "score": float(s)} for i, s in enumerate(scores)]
    return list_answer("score", rows, body.model or state.config.model_name, timings)


def score_side(side: Any, name: str, together: bool = False) -> list[str | ImageItem | PartsItem]:
    """A side of a score body as its items: one item (a text or `{"content": [parts]}`), or
    a list of them."""
    if isinstance(side, list):
        return [score_item(item, f"{name}[{i}]", together) for i, item in enumerate(side)]
    return [score_item(side, name, together)]


@router.post(
    "/classify",
    openapi_extra=openapi_body(ClassifyRequest, ClassifyChatRequest, InfinityClassifyRequest),
)
async def create_classify(request: Request) -> Response:
    """Class probabilities (raw logits with use_activation=false) per input. A body with
    `raw_scores` is Infinity's and gets its answer."""
    state = get_state(request)
    return await classify(request, await read_json(request, state.config.max_payload_bytes))


async def classify(request: Request, data: dict[str, Any]) -> Response:
    if "raw_scores" in data:
        return await infinity_classify(request, data)
    state = get_state(request)
    body = validate(ClassifyChatRequest if "messages" in data else ClassifyRequest, data)
    state = state.for_model(body.model)
    inputs = TextInputs(state, body)
    options = ClassifyOptions(
        use_activation=body.use_activation,
        truncate_prompt_tokens=state.truncate(body),
        truncation_side=body.truncation_side,
        add_special_tokens=inputs.add_special_tokens,
    )

    probs, timings = await inputs.run(
        request, lambda ctx, items: calls.prepare_classify(ctx, items, options)
    )
    rendered = await asyncio.to_thread(_classes, probs, state.info.id2label)
    return list_answer("classify", rendered, body.model or state.config.model_name, timings)


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


@answered_as(infinity_error)
async def infinity_classify(request: Request, data: dict[str, Any]) -> Response:
    """Infinity's classify: per input, every label's `{score, label}`, best first; a
    reranker (a one-label cross-encoder) does not classify, as Infinity's reranker does not."""
    state = get_state(request)
    body = validate(InfinityClassifyRequest, data)
    state = state.for_model(body.model)
    texts = [body.input] if isinstance(body.input, str) else body.input
    state.check_count(len(texts))
    info = state.info
    if info.score_mode == "cross_encoder" and info.num_labels == 1:
        raise ApiError(
            400,
            f"model={body.model or state.config.model_name!r} does not support classify: it "
            "is a reranker (one relevance score); rerank with it",
            code="unsupported_by_model",
        )

    options = ClassifyOptions(
        use_activation=not body.raw_scores,
        truncate_prompt_tokens=state.truncate(),  # Infinity's bodies: --auto-truncate decides
    )

    scores, timings = await run_call_of(
        state, request, texts, lambda ctx: calls.prepare_classify(ctx, texts, options)
    )
    labels = [info.id2label.get(i, f"LABEL_{i}") for i in range(scores.shape[1])]
    data_out = [
        [{"score": float(row[j]), "label": labels[j]} for j in np.argsort(-row, kind="stable")]
        for row in scores
    ]
    return infinity_answer(
        "classify", "data", data_out, body.model or state.config.model_name, timings
    )


def infinity_answer(kind: str, key: str, value: Any, model: str, timings: Timings) -> Response:
    """Infinity's answer of `kind` ("rerank", "classify"): `value` under `key`, with the
    model, the usage, an id and the time."""
    content = {
        "object": kind,
        key: value,
        "model": model,
        "usage": timings.usage(),
        "id": response_id("infinity"),
        "created": int(time.time()),
    }
    return json_response(dumps(content), timings.headers())
