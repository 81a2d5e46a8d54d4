"""What a call sends to the engine (`PromptRequest`), what it gets back per input
(`PoolingOutput`), and a call prepared but not yet run (`PreparedCall`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

import numpy as np

from vecpool.errors import VecpoolError
from vecpool.inputs.prompts import Prompt
from vecpool.tasks import PoolingParams

T = TypeVar("T")


@dataclass(slots=True)  # not frozen: one is built per input, and frozen init is slow
class PromptRequest:
    """One validated input and what to compute from it: all an engine needs to run it.

    Plain values (no engine state), so a front without the model can build it and send it
    to the engine, in this process or another."""

    index: int  # position of the input in its call (errors name it)
    prompt: Prompt
    params: PoolingParams


@dataclass(slots=True)  # not frozen: one is built per input, and frozen init is slow
class PoolingOutput:
    """The outcome of one input: `data` when it succeeded, `error` when it failed."""

    index: int  # position of the input in its call
    data: np.ndarray | None  # [dim] for sequence tasks, [num_tokens, dim] for per-token tasks
    error: VecpoolError | None
    num_prompt_tokens: int


@dataclass
class RunTimes:
    """Where one run's time went in the engine (seconds); filled in by the front that ran it."""

    queue: float = 0.0  # from submission to the start of the first step that ran one of them
    inference: float = 0.0  # from that step's start to the last request done


@dataclass(frozen=True)
class PreparedCall(Generic[T]):
    """The requests of one call, validated and tokenized but not yet run, and how their
    outputs become the call's result.

    `Engine.run(call)` runs it; an async front runs `call.requests` itself (e.g.
    `AsyncEngine.run`) and passes the outputs, in request order, to `call.finish`, which raises
    the first failed input's error.
    """

    requests: list[PromptRequest]
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
