"""What a call returns per input, and a call prepared for the engine but not yet run."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

import numpy as np

from vecpool.engine.request import Request
from vecpool.errors import InputError, VecpoolError

T = TypeVar("T")


@dataclass(slots=True)  # not frozen: one is built per input, and frozen init is slow
class PoolingOutput:
    """The outcome of one input: `data` when it succeeded, `error` when it failed."""

    index: int  # position of the input in its call
    data: np.ndarray | None  # [dim] for sequence tasks, [num_tokens, dim] for per-token tasks
    error: VecpoolError | None
    num_prompt_tokens: int


def outcome(request: Request) -> PoolingOutput:
    """The `PoolingOutput` of a done request whose `user_data` is its index in its call."""
    index = int(request.user_data)
    error = request.error
    if isinstance(error, InputError):
        error = error.at(index)
    return PoolingOutput(
        index=index, data=request.output, error=error, num_prompt_tokens=request.num_prompt_tokens
    )


@dataclass(frozen=True)
class PreparedCall(Generic[T]):
    """The requests of one offline call, validated and tokenized but not yet submitted, and how
    their outputs become the call's result.

    `Engine.run(call)` runs it; an async front submits `call.requests` itself (e.g.
    `AsyncEngine.run`) and passes the outputs, in request order, to `call.finish`, which raises
    the first failed input's error.
    """

    requests: list[Request]
    finish: Callable[[list[PoolingOutput]], T]


def output_data(outputs: list[PoolingOutput]) -> list[np.ndarray]:
    """Every output's data, in order; raises the first failed output's error."""
    data = []
    for out in outputs:
        if out.error is not None:
            raise out.error
        assert out.data is not None
        data.append(out.data)
    return data
