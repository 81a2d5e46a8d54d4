"""`GET /v1/models`, `/health` and `/metrics`."""

from __future__ import annotations

from fastapi import APIRouter
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.requests import Request
from starlette.responses import Response

from vecpool.server.routes.common import dumps, json_response
from vecpool.server.state import get_state

router = APIRouter()


@router.get("/v1/models")
@router.get("/models")  # Infinity's
async def list_models(request: Request) -> Response:
    """Every served model, each under each of its names, the default (first) model first."""
    state = get_state(request)
    models = [
        {
            "id": name,
            "object": "model",
            "created": state.created,
            "owned_by": "vecpool",
            "max_model_len": model.info.max_model_len,
            "hidden_size": model.info.hidden_size,
            "output_dim": model.info.output_dim,
            "tasks": list(model.info.tasks),
            "score_mode": model.info.score_mode,  # how /score and /rerank compare texts
        }
        for model in state.each_model()
        for name in model.config.model_names
    ]
    return json_response(dumps({"object": "list", "data": models}))


@router.get("/health")
async def health(request: Request) -> Response:
    """200 while every engine runs, 503 otherwise (naming the engine processes gone)."""
    get_state(request).check_health()
    return json_response(dumps({"status": "ok"}))


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    return Response(get_state(request).metrics.render(), media_type=CONTENT_TYPE_LATEST)
