"""A done engine request as its call's `PoolingOutput` (`outcome`); the types a call sends and
gets back live in `vecpool.calls.outputs` (model-free) and are re-exported here."""

from __future__ import annotations

from vecpool.calls.outputs import (
    PoolingOutput,
    PreparedCall,
    PromptRequest,
    RunTimes,
    T,
    output_data,
)
from vecpool.engine.request import Request
from vecpool.errors import InputError

__all__ = [
    "PoolingOutput",
    "PreparedCall",
    "PromptRequest",
    "RunTimes",
    "T",
    "outcome",
    "output_data",
]


def outcome(request: Request) -> PoolingOutput:
    """The `PoolingOutput` of a done request whose `user_data` is its index in its call."""
    index = int(request.user_data)
    error = request.error
    if isinstance(error, InputError):
        error = error.at(index)
    return PoolingOutput(
        index=index, data=request.output, error=error, num_prompt_tokens=request.num_prompt_tokens
    )
