"""`POST /tokenize` (vLLM's shape, or Text Embeddings Inference's with `inputs`) and
`POST /detokenize`."""

from __future__ import annotations

from fastapi import APIRouter
from starlette.requests import Request
from starlette.responses import Response

from vecpool import calls
from vecpool.server.protocol import (
    DetokenizeRequest,
    TeiTokenizeRequest,
    TokenizeRequest,
    openapi_body,
)
from vecpool.server.routes import tei as tei_routes
from vecpool.server.routes.common import dumps, in_executor, json_response, read_body, read_json
from vecpool.server.routes.common import validate as validate_body
from vecpool.server.state import get_state

router = APIRouter()


@router.post("/tokenize", openapi_extra=openapi_body(TokenizeRequest, TeiTokenizeRequest))
async def tokenize(request: Request) -> Response:
    """The token ids a text becomes (special tokens and instruction prompt included, unless
    `add_special_tokens` is false), with `return_token_strs` their strings. A body with
    `inputs` is Text Embeddings Inference's and gets its answer."""
    state = get_state(request)
    data = await read_json(request, state.config.max_payload_bytes)
    if "inputs" in data:
        return await tei_routes.tokenize(request, data)
    body = validate_body(TokenizeRequest, data)
    state = state.for_model(body.model)
    text = await in_executor(
        state,
        request,
        lambda: calls.tokenize_text(
            state.context,
            body.prompt,
            prompt_name=body.prompt_name,
            add_special_tokens=body.add_special_tokens,
        ),
        "prompt",
    )
    content = {
        "count": len(text.ids),
        "max_model_len": state.info.max_model_len,
        "tokens": text.ids,
        "token_strs": text.tokens if body.return_token_strs else None,
    }
    return json_response(dumps(content))


@router.post("/detokenize", openapi_extra=openapi_body(DetokenizeRequest))
async def detokenize(request: Request) -> Response:
    """The text of token ids (special tokens skipped)."""
    state = get_state(request)
    body = await read_body(request, DetokenizeRequest, state.config.max_payload_bytes)
    state = state.for_model(body.model)
    text = await in_executor(
        state, request, lambda: calls.detokenize(state.context, body.tokens), "tokens"
    )
    return json_response(dumps({"prompt": text}))
