"""Amazon SageMaker's two routes: `POST /invocations`, which serves any body by its shape (as
vLLM's and Text Embeddings Inference's containers do), and `GET /ping`.

`/invocations` reads the body's keys: `inputs` is Text Embeddings Inference's (the route of the
model's kind); `query` is a rerank (`documents`: Cohere, Jina, vLLM; `texts`: TEI); the score
names (`text_1`, `data_1`, `queries`) a score; `texts` a Cohere embed; `input` with `task` is
`/pooling`, else `/classify` when the model has a classifier head, else `/v1/embeddings`.
With several models served, the call runs on the model its body's `model` field names, else
the one SageMaker's `X-Amzn-SageMaker-Target-Model` header names, else the first.
"""

from __future__ import annotations

from fastapi import APIRouter
from starlette.requests import Request
from starlette.responses import Response

from vecpool.server.errors import ApiError
from vecpool.server.protocol import (
    SCORE_SHAPES,
    ClassifyRequest,
    CohereEmbedRequest,
    EmbeddingChatRequest,
    EmbeddingRequest,
    PoolingRequest,
    RerankRequest,
    TeiEmbedRequest,
    TeiPredictRequest,
    TeiRerankRequest,
    openapi_body,
)
from vecpool.server.routes.cohere import embed as cohere_embed
from vecpool.server.routes.common import dumps, json_response, read_json
from vecpool.server.routes.embeddings import embeddings
from vecpool.server.routes.pooling import pooling
from vecpool.server.routes.scores import classify, is_tei_rerank, rerank_any, score
from vecpool.server.routes.tei import TARGET_MODEL_HEADER, by_model_kind
from vecpool.server.state import get_state

router = APIRouter()

_SCORE_KEYS = frozenset(name for _, first, second in SCORE_SHAPES for name in (first, second))
_SHAPES = openapi_body(
    EmbeddingRequest,
    EmbeddingChatRequest,
    PoolingRequest,
    ClassifyRequest,
    RerankRequest,
    *(shape for shape, _, _ in SCORE_SHAPES),
    CohereEmbedRequest,
    TeiEmbedRequest,
    TeiPredictRequest,
    TeiRerankRequest,
)


@router.post("/invocations", openapi_extra=_SHAPES)
async def invocations(request: Request) -> Response:
    """The API the body's shape names, answered as that API answers."""
    state = get_state(request)
    data = await read_json(request, state.config.max_payload_bytes)
    keys = set(data)
    # TEI's bodies have no `model` field: its routes read the target-model header themselves.
    tei = "inputs" in keys or ("query" in keys and is_tei_rerank(data))
    target = request.headers.get(TARGET_MODEL_HEADER)
    if target and not tei and "model" not in keys:  # the body's own `model`, given, wins
        data["model"] = target
    if "inputs" in keys:
        return await by_model_kind(request, data)
    if "query" in keys:
        return await rerank_any(request, data)
    if keys & _SCORE_KEYS:
        return await score(request, data)
    if "texts" in keys:
        return await cohere_embed(request, data, version=2)
    if "input" in keys or "messages" in keys:  # messages: vLLM's chat input
        if "task" in keys:
            return await pooling(request, data)
        model = data.get("model")  # the route that model serves (a name not served: a 404)
        tasks = (state.for_model(model) if isinstance(model, str) else state).info.tasks
        if "classify" in tasks:
            return await classify(request, data)
        if "embed" in tasks:
            return await embeddings(request, data)
        return await pooling(request, data)
    raise ApiError(
        400,
        "the body's shape names no API: expected inputs (Text Embeddings Inference), input "
        "or messages (embeddings, classify, pooling), query with documents or texts (rerank), text_1 / "
        "text_2, data_1 / data_2 or queries (score), or texts (Cohere embed)",
        code="unknown_body_shape",
    )


@router.get("/ping")
async def ping(request: Request) -> Response:
    """As /health: 200 while every engine runs, 503 otherwise (SageMaker's health check)."""
    await get_state(request).check_health()
    return json_response(dumps({"status": "ok"}))
