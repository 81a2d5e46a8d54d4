"""Text Embeddings Inference's API: `/embed`, `/embed_all`, `/embed_sparse`, `/predict`,
`/decode`, `/info`, `POST /` (the route of the model's kind), and the TEI shapes of `/rerank`
(`query` and `texts`) and `/tokenize` (`inputs`), which `scores.py` and `tokens.py` hand here.

Answers are TEI's bare JSON arrays; refusals are TEI's `{"error", "error_type"}` with its
statuses (`errors.tei_error`). Every call is the api layer's, as on the other routes: `/embed`
returns the vectors `/v1/embeddings` returns for the same inputs.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import numpy as np
from fastapi import APIRouter
from pydantic import BaseModel
from starlette.requests import Request
from starlette.responses import Response

import vecpool
from vecpool import calls
from vecpool.calls import (
    ClassifyOptions,
    EmbedOptions,
    EncodeOptions,
    EngineInfo,
    RerankOptions,
    SparseOptions,
)
from vecpool.errors import InputError
from vecpool.server.codec import json_type, parse_inputs
from vecpool.server.errors import ApiError, answered_as, input_error, side_errors, tei_error
from vecpool.server.protocol import (
    TeiDecodeRequest,
    TeiEmbedRequest,
    TeiPredictRequest,
    TeiRerankRequest,
    TeiTextParams,
    TeiTokenizeRequest,
    TeiTokensRequest,
    openapi_body,
)
from vecpool.server.routes.common import (
    PER_TOKEN,
    dumps,
    in_executor,
    json_response,
    read_json,
    run_call_of,
    validate,
)
from vecpool.server.state import ServerState, get_state

router = APIRouter()

# SageMaker's header that names the model of a call to an endpoint of several models.
TARGET_MODEL_HEADER = "x-amzn-sagemaker-target-model"

RERANK_ERRORS = side_errors({"query": "query", "documents": "texts"}, {"query": False})


def tei_state(request: Request) -> ServerState:
    """The state of the model a TEI call runs on. TEI's bodies name no model: the first
    model's, unless the URL's `model` query parameter (`/embed?model=NAME`) or SageMaker's
    target-model header names another served one; a name not served is a 404."""
    name = request.query_params.get("model") or request.headers.get(TARGET_MODEL_HEADER)
    return get_state(request).for_model(name or None)


def inputs_error(exc: InputError) -> ApiError:
    return input_error(exc, "inputs")


def model_kind(info: EngineInfo) -> str:
    """What TEI would call the model: "reranker" (one relevance score per pair), "classifier"
    (several labels), "splade" (a masked-LM head) or "embedding"."""
    if info.score_mode in ("llm", "listwise") or (
        info.score_mode == "cross_encoder" and info.num_labels == 1
    ):
        return "reranker"
    if "classify" in info.tasks and info.num_labels > 1:
        return "classifier"
    if "sparse" in info.tasks:  # a masked-LM head: served for its SPLADE vectors
        return "splade"
    return "embedding"


def text_inputs(state: ServerState, value: Any) -> list[str | list[int]]:
    """TEI's `inputs`: a string, a token array, or a list of strings and token arrays."""
    if isinstance(value, list) and not value:
        raise ApiError(400, "`inputs` cannot be empty", param="inputs", code="empty_input")
    try:
        items = parse_inputs(value, "inputs")
    except InputError as exc:
        raise inputs_error(exc) from None
    for i, item in enumerate(items):
        if not isinstance(item, str | list):
            raise ApiError(
                400,
                f"inputs[{i}]: expected a string or a token array, got {json_type(item)}",
                param=f"inputs[{i}]",
                code="invalid_input",
            )
    state.check_count(len(items), "inputs")
    return [item for item in items if isinstance(item, str | list)]


def text_options(state: ServerState, body: TeiTextParams) -> dict[str, Any]:
    """The options of a call that TEI's text parameters set: truncation (`truncate` true: the
    model's limit; null: as the server's --auto-truncate says) and its side."""
    truncate = state.truncate() if body.truncate is None else -1 if body.truncate else None
    return {
        "truncate_prompt_tokens": truncate,
        "truncation_side": body.truncation_direction.lower(),
    }


B = TypeVar("B", TeiEmbedRequest, TeiTokensRequest)
Handler = Callable[[Request, dict[str, Any]], Awaitable[Response]]


def post_route(path: str, body: type[BaseModel]) -> Callable[[Handler], Handler]:
    """Serve the decorated handler at `POST path`, on the JSON it reads (`body`: its schema in
    the OpenAPI document), as the route `create_{handler}`; the handler itself is also called
    with a parsed body (`POST /` of the model's kind, SageMaker's invocations)."""

    def register(handler: Handler) -> Handler:
        async def route(request: Request) -> Response:
            return await handler(request, await _read(request))

        route.__name__ = route.__qualname__ = f"create_{handler.__name__}"
        router.add_api_route(path, route, methods=["POST"], openapi_extra=openapi_body(body))
        return handler

    return register


def read_text_call(
    request: Request, data: dict[str, Any], model: type[B]
) -> tuple[ServerState, B, list[str | list[int]]]:
    """A call on TEI's `inputs`: the state of its model, its body, and its inputs."""
    state = tei_state(request)
    body = validate(model, data)
    return state, body, text_inputs(state, body.inputs)


@post_route("/embed", TeiEmbedRequest)
@answered_as(tei_error)
async def embed(request: Request, data: dict[str, Any]) -> Response:
    """One vector per input (normalized unless `normalize` is false, TEI's default)."""
    state, body, items = read_text_call(request, data, TeiEmbedRequest)
    options = EmbedOptions(
        dimensions=body.dimensions,
        normalize=body.normalize,
        prompt_name=body.prompt_name,
        **text_options(state, body),
    )
    return await _encode(request, state, items, options.encode())


@post_route("/embed_all", TeiTokensRequest)
@answered_as(tei_error)
async def embed_all(request: Request, data: dict[str, Any]) -> Response:
    """Every token's vector, unpooled and not normalized: `[n_tokens, dim]` per input."""
    state, body, items = read_text_call(request, data, TeiTokensRequest)
    options = EncodeOptions(
        task="token_embed",
        normalize=False,
        prompt_name=body.prompt_name,
        **text_options(state, body),
    )
    return await _encode(request, state, items, options)


async def _encode(
    request: Request, state: ServerState, items: list[str | list[int]], options: EncodeOptions
) -> Response:
    """`calls.prepare_encode` of `items` with `options`, answered as TEI does: an array (of
    arrays) per input."""

    arrays, timings = await run_call_of(
        state,
        request,
        items,  # a data:image/ string is an image
        lambda ctx: calls.prepare_encode(ctx, items, options),
        inputs_error,
        per_token=options.task in PER_TOKEN,
    )
    content = await asyncio.to_thread(lambda: dumps([a.tolist() for a in arrays]))
    return json_response(content, timings.headers())


@post_route("/embed_sparse", TeiTokensRequest)
@answered_as(tei_error)
async def embed_sparse(request: Request, data: dict[str, Any]) -> Response:
    """SPLADE vectors: `[{"index": token id, "value": weight}]` per input, by token id."""
    state, body, items = read_text_call(request, data, TeiTokensRequest)
    options = SparseOptions(prompt_name=body.prompt_name, **text_options(state, body))

    vectors, timings = await run_call_of(
        state,
        request,
        items,
        lambda ctx: calls.prepare_embed_sparse(ctx, items, options),
        inputs_error,
    )
    content = [[{"index": i, "value": w} for i, w in sorted(vector.items())] for vector in vectors]
    return json_response(dumps(content), timings.headers())


@post_route("/predict", TeiPredictRequest)
@answered_as(tei_error)
async def predict(request: Request, data: dict[str, Any]) -> Response:
    """Each label's score, best first: for one input (a text or a pair) a list, for a batch
    a list per input."""
    state = tei_state(request)
    body = validate(TeiPredictRequest, data)
    items, single = predict_inputs(body.inputs)
    state.check_count(len(items), "inputs")
    options = ClassifyOptions(
        use_activation=False if body.raw_scores else None, **text_options(state, body)
    )

    scores, timings = await run_call_of(
        state, request, items, lambda ctx: calls.prepare_classify(ctx, items, options), inputs_error
    )
    labels = state.info.id2label
    predictions = [
        [
            {"score": float(row[i]), "label": labels.get(int(i), f"LABEL_{int(i)}")}
            for i in np.argsort(-row, kind="stable")
        ]
        for row in scores
    ]
    return json_response(dumps(predictions[0] if single else predictions), timings.headers())


def predict_inputs(value: Any) -> tuple[list[Any], bool]:
    """TEI's predict `inputs` as classify inputs, and whether it was one input: a string, a
    pair [string, string], or a batch of [string] and [string, string] lists."""

    def sequence(item: list[Any], where: str) -> Any:
        if len(item) not in (1, 2) or not all(isinstance(s, str) for s in item):
            raise ApiError(
                400,
                f"{where}: a sequence is [string] or a pair [string, string]",
                param=where,
                code="invalid_input",
            )
        return item[0] if len(item) == 1 else {"text": item[0], "text_pair": item[1]}

    if isinstance(value, str):
        return [value], True
    if isinstance(value, list) and value and isinstance(value[0], str):
        return [sequence(value, "inputs")], True
    if isinstance(value, list) and value and all(isinstance(v, list) for v in value):
        return [sequence(v, f"inputs[{i}]") for i, v in enumerate(value)], False
    if isinstance(value, list) and not value:
        raise ApiError(400, "`inputs` cannot be empty", param="inputs", code="empty_input")
    raise ApiError(
        400,
        "inputs: expected a string, a pair [string, string], or a batch [[string], "
        f"[string, string], ...]; got {json_type(value)}",
        param="inputs",
        code="invalid_input",
    )


@answered_as(tei_error)
async def rerank(request: Request, data: dict[str, Any]) -> Response:
    """`/rerank` with `query` and `texts`: `[{"index", "score", "text"?}]`, best first."""
    state = tei_state(request)
    body = validate(TeiRerankRequest, data)
    if not body.texts:
        raise ApiError(400, "`texts` cannot be empty", param="texts", code="empty_input")
    state.check_count(len(body.texts), "texts")
    options = RerankOptions(
        use_activation=False if body.raw_scores else None, **text_options(state, body)
    )

    ranked, timings = await run_call_of(
        state,
        request,
        [body.query, *body.texts],
        lambda ctx: calls.prepare_rerank(ctx, body.query, body.texts, options=options),
        RERANK_ERRORS,
    )
    ranks = []
    for index, score in ranked:
        rank: dict[str, Any] = {"index": index, "score": score}
        if body.return_text:
            rank["text"] = body.texts[index]
        ranks.append(rank)
    return json_response(dumps(ranks), timings.headers())


@answered_as(tei_error)
async def tokenize(request: Request, data: dict[str, Any]) -> Response:
    """`/tokenize` with `inputs`: per input, its tokens as `{"id", "text", "special", "start",
    "stop"}` (a special token's text is its vocabulary entry, without offsets)."""
    state = tei_state(request)
    body = validate(TeiTokenizeRequest, data)
    texts = [body.inputs] if isinstance(body.inputs, str) else body.inputs
    if not texts:
        raise ApiError(400, "`inputs` cannot be empty", param="inputs", code="empty_input")
    state.check_count(len(texts), "inputs")

    def run() -> list[list[dict[str, Any]]]:
        out = []
        for i, text in enumerate(texts):
            try:
                tokenized = calls.tokenize_text(
                    state.context,
                    text,
                    prompt_name=body.prompt_name,
                    add_special_tokens=body.add_special_tokens,
                )
            except InputError as exc:
                raise InputError(exc.reason, index=i if len(texts) > 1 else None) from None
            out.append(
                [
                    {"id": token_id, "text": token, "special": True, "start": None, "stop": None}
                    if special
                    else {
                        "id": token_id,
                        "text": tokenized.text[start:stop],
                        "special": False,
                        "start": start,
                        "stop": stop,
                    }
                    for token_id, token, special, (start, stop) in zip(
                        tokenized.ids,
                        tokenized.tokens,
                        tokenized.special,
                        tokenized.offsets,
                        strict=True,
                    )
                ]
            )
        return out

    return json_response(dumps(await in_executor(state, request, run, "inputs")))


@post_route("/decode", TeiDecodeRequest)
@answered_as(tei_error)
async def decode(request: Request, data: dict[str, Any]) -> Response:
    """The text of each id list (`ids` one list, or a batch of lists)."""
    state = tei_state(request)
    body = validate(TeiDecodeRequest, data)
    ids = body.ids
    if not ids:
        raise ApiError(400, "`ids` cannot be empty", param="ids", code="empty_input")
    single = isinstance(ids[0], int)
    batch = [ids] if single else ids
    if not single:
        state.check_count(len(batch), "ids")

    def run() -> list[str]:
        out = []
        for i, one in enumerate(batch):
            try:
                out.append(
                    calls.detokenize(
                        state.context,
                        one,  # type: ignore[arg-type]
                        skip_special_tokens=body.skip_special_tokens,
                    )
                )
            except InputError as exc:
                raise InputError(exc.reason, index=None if single else i) from None
        return out

    return json_response(dumps(await in_executor(state, request, run, "ids")))


@router.get("/")
async def health(request: Request) -> Response:
    """TEI's health check at the root: 200 while the engine runs, 503 otherwise."""
    tei_state(request).running_client()
    return json_response(dumps({"status": "ok"}))


@router.get("/info")
async def info(request: Request) -> Response:
    """The model and the server's limits, as TEI describes them."""
    state = tei_state(request)
    info, config = state.info, state.config
    kind = model_kind(info)
    if kind in ("reranker", "classifier"):
        id2label = {str(i): info.id2label.get(i, f"LABEL_{i}") for i in range(info.num_labels)}
        label2id = {label: int(i) for i, label in id2label.items()}
        model_type: dict[str, Any] = {kind: {"id2label": id2label, "label2id": label2id}}
    else:
        pooling = "splade" if kind == "splade" else info.pooling.lower()
        model_type = {"embedding": {"pooling": pooling}}
    content = {
        "model_id": config.model_name,
        "model_sha": None,
        "model_dtype": info.dtype,
        "model_type": model_type,
        "model_impl": info.model_impl,  # vecpool's: "vecpool" (native) or "transformers"
        "max_concurrent_requests": config.max_queued,
        "max_input_length": info.max_model_len,
        "max_batch_tokens": info.max_num_batched_tokens,
        "max_batch_requests": info.max_num_seqs,
        "max_client_batch_size": config.max_batch_inputs,
        "auto_truncate": config.auto_truncate,
        "tokenization_workers": config.tokenizer_threads,
        "version": vecpool.__version__,
        "sha": None,
        "docker_label": None,
    }
    return json_response(dumps(content))


ROOT_BODIES = openapi_body(TeiEmbedRequest, TeiPredictRequest, TeiRerankRequest, TeiTokensRequest)


@router.post("/", openapi_extra=ROOT_BODIES)
async def root(request: Request) -> Response:
    """TEI's route of the model's kind: `/embed` for an embedding model, `/predict` for a
    classifier, `/rerank` for a reranker, `/embed_sparse` for SPLADE (what Hugging Face's
    `InferenceClient` posts to a base URL)."""
    return await by_model_kind(request, await _read(request))


async def by_model_kind(request: Request, data: dict[str, Any]) -> Response:
    kind = model_kind(tei_state(request).info)
    if kind == "reranker":
        return await rerank(request, data)
    if kind == "classifier":
        return await predict(request, data)
    if kind == "splade":
        return await embed_sparse(request, data)
    return await embed(request, data)


@answered_as(tei_error)
async def _read(request: Request) -> dict[str, Any]:
    return await read_json(request, get_state(request).config.max_payload_bytes)
