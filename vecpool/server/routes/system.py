"""`GET /v1/models`, `/health` and `/metrics`."""

from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.requests import Request
from starlette.responses import Response

from vecpool.calls import EngineInfo
from vecpool.server.routes.common import dumps, json_response
from vecpool.server.state import ServerState, get_state

router = APIRouter()


@router.get("/v1/models")
@router.get("/models")  # Infinity's
async def list_models(request: Request) -> Response:
    """Every served model, each under each of its names, the default (first) model first."""
    state = get_state(request)
    models = [
        _model_card(state, model, name)
        for model in state.each_model()
        for name in model.config.model_names
    ]
    return json_response(dumps({"object": "list", "data": models}))


@router.get("/v1/models/{name:path}")
async def retrieve_model(request: Request, name: str) -> Response:
    """One served model under `name` (OpenAI's retrieve), or a 404 naming what is served."""
    state = get_state(request)
    return json_response(dumps(_model_card(state, state.for_model(name), name)))


def _model_card(state: ServerState, model: ServerState, name: str) -> dict[str, Any]:
    return {
        "id": name,
        "object": "model",
        "created": state.created,
        "owned_by": "vecpool",
        "max_model_len": model.info.max_model_len,
        "hidden_size": model.info.hidden_size,
        "output_dim": model.info.output_dim,
        "tasks": list(model.info.tasks),
        "score_mode": model.info.score_mode,  # how /score and /rerank compare texts
        # Infinity's fields: its clients read the queue and what the model can do.
        "stats": _stats(model),
        "backend": "vecpool",
        "capabilities": capabilities(model.info),
    }


def _stats(model: ServerState) -> dict[str, float | int]:
    """Infinity's queue figures of one served model."""
    client = model.client
    queued = 0 if client is None else client.num_queued
    max_queued = 0 if client is None else client.max_queued
    return {
        "queue_fraction": queued / max_queued if max_queued else 0.0,
        "queue_absolute": queued,
        "results_pending": queued,  # inputs queued or running: none waits once it is done
        "batch_size": model.info.max_num_seqs,
    }


@router.get("/health")
async def health(request: Request) -> Response:
    """200 while every engine runs and answers, 503 otherwise (naming those gone or stuck)."""
    await get_state(request).check_health()
    return json_response(dumps({"status": "ok", "unix": time.time()}))


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    return Response(get_state(request).metrics.render(), media_type=CONTENT_TYPE_LATEST)


def capabilities(info: EngineInfo) -> list[str]:
    """What the model is for, in Infinity's words (what its routes serve it for): `embed`
    (an embedding model), `image_embed` (one with an image tower: CLIP, SigLIP), `rerank` (a
    one-score cross-encoder, an LLM or listwise reranker), `classify` (a classifier with
    several labels)."""
    reranker = info.score_mode in ("llm", "listwise") or (
        info.score_mode == "cross_encoder" and info.num_labels == 1
    )
    out = []
    # A classifier or cross-encoder serves embed only when asked to (`--task embed`).
    if "embed" in info.tasks and (info.num_labels > 0 or not reranker):
        out.append("embed")
        if info.image_processor_dir is not None:
            out.append("image_embed")
    if reranker:
        out.append("rerank")
    if "classify" in info.tasks and info.num_labels > 1:
        out.append("classify")
    return out
