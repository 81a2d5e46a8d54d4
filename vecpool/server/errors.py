"""Errors as the OpenAI API shapes them: `{"error": {"message", "type", "param", "code"}}`.

Every request the server refuses gets one of these bodies, in the dialect of the API its route
belongs to (`in_dialect`): OpenAI's on OpenAI's routes, vLLM's on vLLM's own (`type` vLLM's
exception name, `code` the status), and the peers' own shapes on theirs (`PeerError`: TEI,
Cohere, Infinity). Bad input is a 4xx that names the field and, for a list input, its index
(`param` is e.g. `"input[2].prompt_embeds"`); request validation errors (malformed JSON, wrong
types, unknown fields) are 400, never 422, except where a peer answers 422.
"""

from __future__ import annotations

import functools
import json
import uuid
from collections.abc import Awaitable, Callable
from http import HTTPStatus
from typing import Any, TypeVar, cast

from vecpool.errors import InputError, InputTooLongError
from vecpool.inputs.prompts import REDUCE_LENGTH

# InputError fields that are request parameters rather than parts of one input.
_PARAM_FIELDS = frozenset(
    {
        "dimensions",
        "exclude_special_tokens",
        "normalize",
        "prompt_name",
        "step_tag_id",
        "task",
        "truncate_prompt_tokens",
        "truncation_side",
    }
)
# Fields that name the input itself (a token array is the input, not a part of it).
_INPUT_FIELDS = frozenset({"prompt_token_ids", "prompt", "input"})

_TYPES = {
    401: "invalid_request_error",
    404: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
}


class ApiError(Exception):
    """A refusal with an HTTP status and an OpenAI-shaped body."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        type: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or _TYPES.get(
            status, "invalid_request_error" if status < 500 else "server_error"
        )
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def content(self) -> bytes:
        return json.dumps(self.body()).encode()


class BodyError(ApiError):
    """A 400 for a body its route's model refuses (a field of the wrong type, not one of the
    allowed values, missing or unknown): pydantic's error `kind` (e.g. `literal_error`) and
    the value refused, which vLLM's answer names (FastAPI's validation error, which it
    reports)."""

    def __init__(self, message: str, *, param: str | None, kind: str, value: Any):
        super().__init__(400, message, param=param, code=kind)
        self.kind = kind
        shown = repr(value)
        self.value = shown if len(shown) <= 100 else shown[:97] + "..."


class ClientDisconnectedError(Exception):
    """The client closed its connection before the answer was ready; its work was cancelled."""


def http_error(status: int, detail: str | None = None) -> ApiError:
    """An `ApiError` for a plain HTTP status (unknown path, wrong method, ...)."""
    phrase = HTTPStatus(status).phrase
    code = phrase.lower().replace(" ", "_")
    return ApiError(status, detail or phrase, code=code)


def release_frames(exc: BaseException) -> None:
    """Drop the tracebacks of an answered exception and of the exceptions it chains to. A
    frame that caught one exception and raised another (`except InputError as exc: raise
    ApiError(...)`) keeps the first in its locals while that exception's traceback keeps the
    frame: a reference cycle, which held every frame of the traceback and what they held (a
    refused call's body and decoded inputs, prompt embeds of up to a few times the body's
    size) until the collector's next full pass. Without the tracebacks, reference counts free
    them with the answer. The frames themselves are left as they are (a frame still running
    keeps its locals)."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        current.__traceback__ = None
        current = current.__cause__ or current.__context__


def input_error(exc: InputError, list_name: str = "input") -> ApiError:
    """A 400 for an `InputError`, whose `param` names the request field or the list item."""
    field = exc.field
    if field in _PARAM_FIELDS:
        param: str | None = field
    elif exc.index is not None:
        param = f"{list_name}[{exc.index}]"
        if field is not None and field not in _INPUT_FIELDS:
            param += f".{field}"
    else:
        param = field or list_name
    return ApiError(400, str(exc), param=param, code=input_code(exc))


def input_code(exc: InputError) -> str:
    """The `code` of an `InputError`'s 400: `input_too_long` for an input over a length limit
    (which some APIs answer with their own status), else `invalid_input`."""
    return "input_too_long" if isinstance(exc, InputTooLongError) else "invalid_input"


def side_errors(
    names: dict[str, str], indexed: dict[str, bool]
) -> Callable[[InputError], ApiError]:
    """Maps an error naming a side of the call (`names`: the api's field -> the request's) to
    a 400 whose `param` is the request's field, with the item's index where the field was a
    list (`indexed`). An error about no input and no field is about the model: no param."""

    def to_api_error(exc: InputError) -> ApiError:
        side, _, rest = (exc.field or "").partition(".")
        if side in names:
            param = names[side]
            if exc.index is not None and indexed.get(side, True):
                param += f"[{exc.index}]"
            if rest:
                param += f".{rest}"
            return ApiError(400, f"{param}: {exc.reason}", param=param, code=input_code(exc))
        if exc.field is None and exc.index is None:
            # vLLM serves /score and /rerank only for a model that scores: 404 elsewhere.
            return ApiError(404, exc.reason, code="unsupported_by_model")
        return input_error(exc)

    return to_api_error


def validation_param(loc: tuple[int | str, ...]) -> str | None:
    """A pydantic error location as a param: `("input", 2, "text")` -> `"input[2].text"`.

    Union members in the location (`str`, `list[int]`, `RerankDocument`, ...) are left out:
    our field names are lowercase identifiers, never builtin type names.
    """
    param = ""
    for part in loc:
        if isinstance(part, int):
            param += f"[{part}]"
        elif not _is_union_member(part):
            param += f".{part}" if param else part
    return param or None


def _is_union_member(part: str) -> bool:
    return part in {"str", "int", "float", "bool"} or not part.isidentifier() or part[0].isupper()


# ---- the peers' own error shapes ---------------------------------------------------------

# The paths whose API is vLLM's (`/rerank` and `/classify` are also the paths of other peers'
# shapes: their routes answer those in the peers' shapes, as `PeerError`s, which are kept).
VLLM_PATHS = frozenset(
    {
        "/pooling",
        "/score",
        "/v1/score",
        "/classify",
        "/rerank",
        "/v1/rerank",
        "/v2/rerank",
        "/tokenize",
        "/detokenize",
    }
)
# vLLM's error types by status: the exception its serving code raises (vLLM's
# `create_error_response`), the class name the OpenAI client raises for that status.
_VLLM_TYPES = {400: "BadRequestError", 404: "NotFoundError", 501: "NotImplementedError"}
# vLLM's words for an input over the model's length (since its renderer checks lengths).
VLLM_REDUCE_LENGTH = "Please reduce the length of the input prompt."


class PeerError(ApiError):
    """An `ApiError` answered in a peer API's body shape, on that peer's routes."""

    def __init__(self, error: ApiError, status: int, body: dict[str, Any]):
        super().__init__(
            status,
            error.message,
            param=error.param,
            code=error.code,
            type=error.type,
            headers=error.headers,
        )
        self._body = body

    def body(self) -> dict[str, Any]:
        return self._body


# Text Embeddings Inference's error types and their statuses.
_TEI_BY_CODE = {
    "invalid_json": (400, "validation"),
    "empty_input": (400, "empty"),
    "payload_too_large": (413, "validation"),
    "too_many_inputs": (413, "validation"),
    "invalid_input": (413, "validation"),  # TEI's validation errors (e.g. too long) are 413
    "input_too_long": (413, "validation"),
    "unsupported_by_model": (424, "backend"),
    "engine_error": (424, "backend"),
    "queue_full": (429, "overloaded"),
    "unavailable": (503, "unhealthy"),
}


def tei_error(error: ApiError) -> ApiError:
    """`error` as Text Embeddings Inference answers: `{"error": message, "error_type": ...}`
    with its status for that type (validation 413 or 422, empty 400, backend 424,
    overloaded 429, unhealthy 503)."""
    if isinstance(error, PeerError):
        return error
    if error.param == "task":  # a route the model cannot serve ("not a re-ranker model")
        status, kind = 424, "backend"
    elif error.code in _TEI_BY_CODE:
        status, kind = _TEI_BY_CODE[error.code]
    elif error.status == 400:  # a body of the wrong types, as TEI's JSON extractor answers
        status, kind = 422, "validation"
    else:
        status, kind = error.status, "backend" if error.status >= 500 else "validation"
    return PeerError(error, status, {"error": error.message, "error_type": kind})


def in_dialect(path: str, error: ApiError) -> ApiError:
    """`error` as the API of the route at `path` answers it: vLLM's shape on vLLM's paths
    (`vllm_error`); a peer's shape already given (`PeerError`) and every other path as is."""
    if path in VLLM_PATHS and not isinstance(error, PeerError):
        return vllm_error(error)
    return error


def vllm_error(error: ApiError) -> ApiError:
    """`error` as vLLM answers it: `{"error": {"message", "type", "param", "code"}}` with
    `type` vLLM's name for it ("BadRequestError" for a 400, "NotFoundError", ...;
    "Bad Request" for a body its models refuse, whose message then carries pydantic's error
    type and the value, as FastAPI's validation error does) and `code` the HTTP status. An
    input over the model's length says so in vLLM's words; a route the model does not serve
    (score and rerank for a model that scores no pairs, where vLLM has no route) also carries
    FastAPI's `{"detail": "Not Found"}`."""
    if isinstance(error, PeerError):
        return error
    message = error.message
    if isinstance(error, BodyError):
        kind = "Bad Request"
        message += f" [type={error.kind}, input_value={error.value}]"
    elif error.status >= 500:
        kind = _VLLM_TYPES.get(error.status, "InternalServerError")
    else:
        kind = _VLLM_TYPES.get(error.status, error.type)
    if error.code == "input_too_long":
        message = message.replace(REDUCE_LENGTH, VLLM_REDUCE_LENGTH)
    if error.param == "task":  # a task refused: vLLM's words ("Unsupported task: ...") first
        message = message.removeprefix("task: ")
    body: dict[str, Any] = {
        "error": {"message": message, "type": kind, "param": error.param, "code": error.status}
    }
    if error.status == 404 and error.code == "unsupported_by_model":
        body["detail"] = "Not Found"
    answer = PeerError(error, error.status, body)
    answer.message, answer.type = message, kind
    return answer


def cohere_error(error: ApiError) -> ApiError:
    """`error` as Cohere answers: `{"id": ..., "message": ...}`, the same status."""
    if isinstance(error, PeerError):
        return error
    return PeerError(error, error.status, {"id": uuid.uuid4().hex, "message": error.message})


def infinity_error(error: ApiError) -> ApiError:
    """`error` as Infinity answers (FastAPI's): a body it cannot validate, or an input it
    refuses (too long, an empty list), is a 422; a task the model does not serve a 400
    "ModelNotDeployedError"; the body keeps the OpenAI shape, as Infinity's own errors do
    (a `PeerError`: on a path it shares with vLLM, it stays in this shape)."""
    if isinstance(error, PeerError):
        return error
    status, message = error.status, error.message
    if status == 400 and (error.param == "task" or error.code == "unsupported_by_model"):
        message = f"ModelNotDeployedError: {message}"
    elif status == 400:
        status = 422
    shaped = ApiError(
        status, message, param=error.param, code=error.code, type=error.type, headers=error.headers
    )
    return PeerError(shaped, status, shaped.body())


Handler = TypeVar("Handler", bound=Callable[..., Awaitable[Any]])


def answered_as(shape: Callable[[ApiError], ApiError]) -> Callable[[Handler], Handler]:
    """A decorator: the handler's refusals (`ApiError`, and `InputError` as a 400) in `shape`."""

    def wrap(handler: Handler) -> Handler:
        @functools.wraps(handler)
        async def shaped(*args: Any, **kwargs: Any) -> Any:
            try:
                return await handler(*args, **kwargs)
            except ApiError as exc:
                raise shape(exc) from None
            except InputError as exc:
                raise shape(input_error(exc)) from None

        return cast(Handler, shaped)

    return wrap
