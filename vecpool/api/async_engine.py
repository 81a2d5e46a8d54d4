"""An asyncio front over `Engine`, in this process: the engine loop runs in its own thread;
requests are futures.

Tokenization and validation run in a thread pool, off the event loop; the loop thread steps the
engine whenever work is queued; a finished request resolves its future on the event loop.
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from vecpool.api import heap
from vecpool.api.admission import Admission
from vecpool.api.engine import Engine
from vecpool.api.outputs import PoolingOutput, PromptRequest, RunTimes, outcome
from vecpool.calls import CallContext, make_requests
from vecpool.calls.info import EngineInfo
from vecpool.engine.request import Request, RequestStatus
from vecpool.errors import EngineDeadError, QueueFullError

__all__ = ["AsyncEngine", "EngineDeadError", "QueueFullError"]  # the errors live in vecpool.errors
from vecpool.inputs.prompts import TextOptions
from vecpool.tasks import PoolingParams

logger = logging.getLogger(__name__)


class AsyncEngine:
    """Wraps an `Engine` for concurrent async callers. Call `start()` once, `shutdown()` at exit.

    `on_step(started, ended)` (perf_counter times), if given, is called by the loop thread after
    every step that ran a batch; `on_request_done(request)` when each request is done (in the
    loop thread, or where it was cancelled).

    A call is admitted while the work ahead of it takes at most `max_wait` seconds at the
    engine's measured speed, and the queue holds at most `max_queued` inputs (`Admission`).
    The engine is unhealthy (`is_running` false) once it is at fault (`EngineCore.healthy`).
    """

    def __init__(
        self,
        engine: Engine,
        *,
        max_queued: int = 4096,
        max_wait: float | None = None,
        tokenizer_threads: int = 4,
        on_step: Callable[[float, float], object] | None = None,
        on_request_done: Callable[[Request], object] | None = None,
    ):
        self.engine = engine
        self.max_queued = max_queued
        self.on_step = on_step
        self.on_request_done = on_request_done
        self.step_started_at = 0.0  # time.perf_counter() when the current or last step began
        self._executor = ThreadPoolExecutor(tokenizer_threads, thread_name_prefix="vecpool-inputs")
        self._wake = threading.Condition()
        self.admission = Admission(max_queued=max_queued, max_wait=max_wait)
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name="vecpool-engine", daemon=True)
        self._pending: set[Request] = set()  # submitted by `run`, not yet done

    @property
    def info(self) -> EngineInfo:
        return self.engine.info()

    @property
    def context(self) -> CallContext:
        return self.engine.context

    @property
    def num_queued(self) -> int:
        return self.admission.queued

    @property
    def expected_wait(self) -> float:
        """Seconds the queued work takes at the engine's measured speed (0: not measured)."""
        return self.admission.expected_wait()

    @property
    def is_running(self) -> bool:
        """Whether the engine loop thread is alive (started and not shut down) and its steps
        are not failing as a whole."""
        return self._thread.is_alive() and self.engine.core.healthy

    @property
    def health_problem(self) -> str | None:
        """Why a health check should fail (the loop is not running), or None."""
        return None if self.is_running else "the engine is not running"

    async def health(self) -> str | None:
        """`health_problem` (the server's health check; the loop runs in this process)."""
        return self.health_problem

    @property
    def retry_after(self) -> float | None:
        """None: an engine at fault here is not restarted (see `vecpool serve`'s supervisor)."""
        return None

    def start(self) -> None:
        self._thread.start()

    def shutdown(self) -> None:
        """Stop the loop thread; the requests it had not finished fail with `EngineDeadError`
        (their callers are answered, not left waiting), and later calls raise it."""
        with self._wake:
            self._stopping = True
            self._wake.notify_all()
        self._thread.join(timeout=30)
        self._executor.shutdown(wait=False, cancel_futures=True)
        with self._wake:
            left = list(self._pending)
        for request in left:  # each removes itself from `_pending` (`_on_done`)
            request.fail(EngineDeadError("the engine was shut down before this input ran"))

    async def make_requests(
        self, inputs: Any, params: PoolingParams, options: TextOptions | None = None
    ) -> list[PromptRequest]:
        """Validate and tokenize in the thread pool; raises `InputError` like `Engine`."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(
            self._executor, make_requests, self.engine.context, inputs, params, options
        )

    async def run(
        self, requests: Sequence[PromptRequest], times: RunTimes | None = None
    ) -> list[PoolingOutput]:
        """Queue `requests` and wait for all of them; their outputs in order. Cancelling the
        caller (e.g. a client that disconnected) cancels its requests: waiting ones never run.
        `times`, if given, receives where the time went."""
        engine_requests = self.engine.submit(requests)
        tokens = sum(r.num_prompt_tokens for r in engine_requests)
        with self._wake:
            if self._stopping or not self._thread.is_alive():
                raise EngineDeadError(
                    "the engine is not running: "
                    + ("it was shut down" if self._stopping else "AsyncEngine.start() not called")
                )
            refusal = self.admission.refusal(len(engine_requests), tokens)
            if refusal is not None:
                raise QueueFullError(refusal)
            self.admission.add(len(engine_requests), tokens)
            # Under the lock that `shutdown` takes: a request is either failed by it or runs.
            self._pending.update(engine_requests)
        submitted = time.perf_counter()
        loop = asyncio.get_running_loop()
        timer = _Timer(self)
        futures = []
        for request in engine_requests:
            future: asyncio.Future[Request] = loop.create_future()
            # Leave the queue count first: a caller woken by its future sees it already down.
            request.add_done_callback(self._on_done)
            request.add_done_callback(timer)
            if self.on_request_done is not None:
                request.add_done_callback(self.on_request_done)
            request.add_done_callback(_resolver(loop, future))
            futures.append(future)
        self.engine.core.add_requests(engine_requests)
        with self._wake:
            self._wake.notify()
        try:
            done = await asyncio.gather(*futures)
        except asyncio.CancelledError:
            for request in engine_requests:
                request.cancel()
            raise
        if times is not None and timer.last_done:
            times.queue = max(0.0, timer.first_step - submitted)
            times.inference = timer.last_done - timer.first_step
        return [outcome(r) for r in done]

    async def pool(
        self, inputs: Any, params: PoolingParams, options: TextOptions | None = None
    ) -> list[PoolingOutput]:
        return await self.run(await self.make_requests(inputs, params, options))

    def _on_done(self, request: Request) -> None:
        with self._wake:
            self.admission.done(request.num_prompt_tokens)
            self._pending.discard(request)

    def _loop(self) -> None:
        core = self.engine.core
        while True:
            with self._wake:
                while not self._stopping and not core.has_work():
                    self._wake.wait()
                if self._stopping:
                    return
            self.step_started_at = time.perf_counter()
            ran = core.guarded_step()  # the loop thread must outlive any one step
            if ran:
                with self._wake:
                    elapsed = time.perf_counter() - self.step_started_at
                    self.admission.on_step(elapsed, core.last_step_tokens)
            if ran and self.on_step is not None:
                try:
                    self.on_step(self.step_started_at, time.perf_counter())
                except Exception:
                    logger.exception("on_step callback raised; continuing")
            heap.freeze_if_compiled()  # a step's compiled code lives as long as the engine


class _Timer:
    """Done callback of one run's requests: when its first step began and its last one ended."""

    def __init__(self, front: AsyncEngine):
        self.front = front
        self.first_step = math.inf
        self.last_done = 0.0

    def __call__(self, request: Request) -> None:
        if request.status in (RequestStatus.FINISHED, RequestStatus.FAILED):
            # Runs in the loop thread, inside the step that finished the request.
            self.first_step = min(self.first_step, self.front.step_started_at)
            self.last_done = max(self.last_done, time.perf_counter())


def _resolver(loop: asyncio.AbstractEventLoop, future: asyncio.Future[Request]) -> Any:
    def resolve(request: Request) -> None:
        def set_result() -> None:
            if not future.done():
                future.set_result(request)

        loop.call_soon_threadsafe(set_result)

    return resolve
