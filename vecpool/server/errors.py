"""Errors as the OpenAI API shapes them: `{"error": {"message", "type", "param", "code"}}`.

Every request the server refuses gets one of these bodies. Bad input is a 4xx that names the
field and, for a list input, its index (`param` is e.g. `"input[2].prompt_embeds"`); request
validation errors (malformed JSON, wrong types, unknown fields) are 400, never 422.
"""

from __future__ import annotations

import json
from http import HTTPStatus
from typing import Any

from vecpool.errors import InputError

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


class ClientDisconnectedError(Exception):
    """The client closed its connection before the answer was ready; its work was cancelled."""


def http_error(status: int, detail: str | None = None) -> ApiError:
    """An `ApiError` for a plain HTTP status (unknown path, wrong method, ...)."""
    phrase = HTTPStatus(status).phrase
    code = phrase.lower().replace(" ", "_")
    return ApiError(status, detail or phrase, code=code)


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
    return ApiError(400, str(exc), param=param, code="invalid_input")


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
