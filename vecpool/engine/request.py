"""Request state. The `Request` owns its counters; nothing else writes them."""

from __future__ import annotations

import enum
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from vecpool.errors import VecpoolError
from vecpool.inputs.prompts import Prompt
from vecpool.tasks import PoolingParams, TaskSpec

logger = logging.getLogger(__name__)


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"
    FAILED = "failed"
    CANCELLED = "cancelled"


# Completion is rare next to everything else a request does; one lock serves them all.
_COMPLETION_LOCK = threading.Lock()


@dataclass(slots=True, eq=False)
class Request:
    """One prompt on its way through the engine."""

    request_id: str
    prompt: Prompt
    params: PoolingParams
    task: TaskSpec
    status: RequestStatus = RequestStatus.WAITING
    # Prompt tokens handed to steps by the scheduler: ahead of `num_computed_tokens` while a
    # step that holds some of them runs (a prompt runs whole, or in chunks over several steps).
    num_scheduled_tokens: int = 0
    num_computed_tokens: int = 0  # prompt tokens already run through the model
    output: np.ndarray | None = None  # set once, when finished
    error: VecpoolError | None = None  # set once, when failed
    user_data: Any = None  # the submitter's tag (e.g. the input's index in its call)
    num_prompt_tokens: int = field(init=False)
    # Finished, failed or cancelled: set once, with the outcome (read in every step's loops,
    # so a plain attribute rather than a test of `status`).
    is_done: bool = field(default=False, init=False)
    _callbacks: list[Callable[[Request], object]] | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        self.num_prompt_tokens = self.prompt.num_tokens

    @property
    def num_unscheduled_tokens(self) -> int:
        """Prompt tokens no step has been given yet."""
        return self.num_prompt_tokens - self.num_scheduled_tokens

    def finish(self, output: np.ndarray) -> None:
        self._complete(RequestStatus.FINISHED, output=output)

    def fail(self, error: VecpoolError) -> None:
        self._complete(RequestStatus.FAILED, error=error)

    def cancel(self) -> None:
        """Drop the request: a waiting one is never scheduled, a running one's result is discarded."""
        self._complete(RequestStatus.CANCELLED)

    def add_done_callback(self, fn: Callable[[Request], object]) -> None:
        """Call `fn(request)` once the request is done (at once if it already is)."""
        with _COMPLETION_LOCK:
            if not self.is_done:
                if self._callbacks is None:
                    self._callbacks = []
                self._callbacks.append(fn)
                return
        fn(self)

    def _complete(
        self,
        status: RequestStatus,
        output: np.ndarray | None = None,
        error: VecpoolError | None = None,
    ) -> None:
        with _COMPLETION_LOCK:
            if self.is_done:  # the first outcome wins (e.g. cancelled, then finished)
                return
            self.output, self.error, self.status = output, error, status
            self.is_done = True
            callbacks, self._callbacks = self._callbacks, None
        for fn in callbacks or ():
            try:
                fn(self)
            except Exception:  # a waiter's failure (e.g. a closed event loop) is not ours
                logger.exception("callback of request %s raised", self.request_id)
