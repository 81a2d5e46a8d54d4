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
from vecpool.inputs import Prompt
from vecpool.tasks import PoolingParams, TaskSpec

logger = logging.getLogger(__name__)


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
    _callbacks: list[Callable[[Request], object]] = field(default_factory=list, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

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
        self._complete(RequestStatus.FINISHED)

    def fail(self, error: VecpoolError) -> None:
        self.error = error
        self._complete(RequestStatus.FAILED)

    def cancel(self) -> None:
        """Drop the request: a waiting one is never scheduled, a running one's result is discarded."""
        self._complete(RequestStatus.CANCELLED)

    def add_done_callback(self, fn: Callable[[Request], object]) -> None:
        """Call `fn(request)` once the request is done (at once if it already is)."""
        with self._lock:
            if not self._done.is_set():
                self._callbacks.append(fn)
                return
        fn(self)

    def _complete(self, status: RequestStatus) -> None:
        with self._lock:
            if self._done.is_set():  # the first outcome wins (e.g. cancelled, then finished)
                return
            self.status = status
            self._done.set()
            callbacks, self._callbacks = self._callbacks, []
        for fn in callbacks:
            try:
                fn(self)
            except Exception:  # a waiter's failure (e.g. a closed event loop) is not ours
                logger.exception("callback of request %s raised", self.request_id)

    def wait(self, timeout: float | None = None) -> bool:
        return self._done.wait(timeout)
