"""Request state. The `Request` owns its counters; nothing else writes them."""

from __future__ import annotations

import enum
import threading
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from vecpool.errors import VecpoolError
from vecpool.inputs import Prompt
from vecpool.tasks import PoolingParams, TaskSpec


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"
    FAILED = "failed"
    CANCELLED = "cancelled"


@dataclass
class Request:
    """One prompt on its way through the engine."""

    request_id: str
    prompt: Prompt
    params: PoolingParams
    task: TaskSpec
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0  # prompt tokens already run through the model
    output: np.ndarray | None = None  # set once, when finished
    error: VecpoolError | None = None  # set once, when failed
    user_data: Any = None  # the submitter's tag (e.g. the input's index in its call)
    _done: threading.Event = field(default_factory=threading.Event, repr=False)

    @property
    def num_prompt_tokens(self) -> int:
        return self.prompt.num_tokens

    @property
    def num_remaining_tokens(self) -> int:
        return self.num_prompt_tokens - self.num_computed_tokens

    @property
    def is_done(self) -> bool:
        return self._done.is_set()

    def finish(self, output: np.ndarray) -> None:
        self.output = output
        self.status = RequestStatus.FINISHED
        self._done.set()

    def fail(self, error: VecpoolError) -> None:
        self.error = error
        self.status = RequestStatus.FAILED
        self._done.set()

    def cancel(self) -> None:
        self.status = RequestStatus.CANCELLED
        self._done.set()

    def wait(self, timeout: float | None = None) -> bool:
        return self._done.wait(timeout)
