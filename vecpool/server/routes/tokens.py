"""`POST /tokenize` and `POST /detokenize`."""

from __future__ import annotations

from fastapi import APIRouter
from starlette.requests import Request
from starlette.responses import Response

from vecpool.api import calls
from vecpool.server.protocol import DetokenizeRequest, TokenizeRequest
from vecpool.server.routes.common import dumps, in_executor, json_response, read_body
from vecpool.server.state import get_state

router = APIRouter()


@router.post("/tokenize")
async def tokenize(request: Request) -> Response:
    """The token ids a text becomes (special tokens and instruction prompt included)."""
    state = get_state(request)
    body = await read_body(request, TokenizeRequest, state.config.max_payload_bytes)
    state.check_model(body.model)
    tokens = await in_executor(
        state,
        request,
        lambda: calls.tokenize(state.context, body.prompt, prompt_name=body.prompt_name),
        "prompt",
    )
    content = {"count": len(tokens), "max_model_len": state.info.max_model_len, "tokens": tokens}
    return json_response(dumps(content))


@router.post("/detokenize")
async def detokenize(request: Request) -> Response:
    """The text of token ids (special tokens skipped)."""
    state = get_state(request)
    body = await read_body(request, DetokenizeRequest, state.config.max_payload_bytes)
    state.check_model(body.model)
    text = await in_executor(
        state, request, lambda: calls.detokenize(state.context, body.tokens), "tokens"
    )
    return json_response(dumps({"prompt": text}))
