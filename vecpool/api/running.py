"""Running prepared calls on an engine's core: requests from a call's `PromptRequest`s
(`submit`: prompt embeds rounded to the model dtype), run to their outputs (`run`, `pool`);
a large call chunk by chunk, the next chunk prepared while the device runs the steps before it
(`run_in_chunks`). `Engine` (engine.py) adds the task methods."""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace
from typing import Any

import numpy as np
import torch
from tqdm import std
from tqdm.auto import tqdm

from vecpool import calls
from vecpool.api import heap
from vecpool.api.build import EngineParts
from vecpool.api.outputs import PoolingOutput, PreparedCall, PromptRequest, T, outcome
from vecpool.engine.request import Request
from vecpool.errors import InputError
from vecpool.inputs.prompts import Prompt, TextOptions
from vecpool.tasks import PoolingParams, get_task

logger = logging.getLogger(__name__)

# Calls with at least this many inputs show a progress bar unless told otherwise.
PROGRESS_THRESHOLD = 256

# Calls larger than this are tokenized chunk by chunk, overlapping the device's work. The
# device waits for the first chunk: 512 rather than 2048 made 4,096 passages from text 7%
# faster on an H200 (Qwen3-0.6B shape); 256 made short queries slower. So the first chunk is
# smaller (the device starts sooner) and the others keep the size that pays; a first chunk of
# 512 was nowhere faster than 128 (BERT-base queries from text 0.86x: ab_first_chunk_h200.json).
PIPELINE_CHUNK = 512
PIPELINE_FIRST_CHUNK = 128
# Chunks being prepared, or prepared and not yet queued, at most, once the engine has run out
# of work before the next chunk was queued: the worker then prepares chunks back to back. A
# chunk of short texts can take longer to tokenize than the host takes to queue a step:
# started only once the chunk before it had joined the queue, it was not ready when the steps
# before it were queued, and the device ran dry before every chunk (BERT-base queries from text
# 1.37x on an H200 with two, in `ahead_h200.json`). Until then one is prepared at a time:
# inputs that are ready in time (ids) ran up to 13% slower with two, the worker's Python then
# taking turns with the engine thread's. (Going two ahead only once the engine blocked on a
# chunk did not engage on the H200, `ahead_adaptive_h200.json`: the chunk that missed the
# steps was mostly ready by the time the last of them had pooled.)
PIPELINE_AHEAD = 2
# An input with images counts as this many texts in a chunk's size: reading a page (decoding,
# resizing, cutting it into patch rows: tens of milliseconds of a core) costs the host hundreds
# of short texts, and its steps keep the device busy as long. So a call of pages starts the
# device after its first 4 pages rather than after all of them (64 pages: the device waited
# for the whole call's reading), and later chunks of 16 pages are read while it runs.
PIPELINE_IMAGE_WEIGHT = 32
# True: the chunks after the first are started only once the first step's forward is queued.
# Begun at once, the worker's Python takes turns for the interpreter lock with the engine
# thread scheduling and building that step (4,096 passages from ids on the CPU: the first
# forward 15 ms after the call began, 6 ms with True). But on an H200 the second chunk is then
# late for the steps after the first, which costs more: with True every workload ran 0-5%
# slower (BERT-base and MiniLM, 5 interleaved rounds, `first_alone_h200.json`).
PIPELINE_FIRST_ALONE = False


def use_thread_lock_for_bars() -> None:
    """For a process that `multiprocessing` started and its parent ends (an engine process of
    `vecpool serve`, of `vecpool embed --data-parallel-size`): progress bars take a thread
    lock. tqdm's default, made with the first bar (the weights' loading), is also a lock of
    `multiprocessing`'s, a named semaphore such a process never unlinks: the interpreter
    warned of it as leaked at the parent's exit. A thread lock does for the bars of one
    process."""
    std.tqdm.set_lock(threading.RLock())  # the class every tqdm bar is one of


class EngineRunner(EngineParts):
    """An engine's parts, and running prepared calls on them (thread-safe)."""

    def run(self, call: PreparedCall[T], *, show_progress: bool | None = None, desc: str = "") -> T:
        """Run a prepared call to its result; raises the first failed input's error."""
        return call.finish(self._execute(self.submit(call.requests), desc, show_progress))

    def pool(
        self,
        inputs: Any,
        params: PoolingParams,
        options: TextOptions | None = None,
        *,
        show_progress: bool | None = None,
    ) -> list[PoolingOutput]:
        """Run `inputs` under `params`; a failure is reported per input, never raised.

        Invalid inputs (bad shape, unknown parameter, ...) still raise `InputError` before
        anything runs, since nothing of the call can be trusted then.
        """
        requests = self.make_requests(inputs, params, options)
        return self._execute(requests, params.task, show_progress)

    def make_requests(
        self, inputs: Any, params: PoolingParams, options: TextOptions | None = None
    ) -> list[Request]:
        """Validate and tokenize `inputs` into engine requests (not yet queued); `InputError`
        on the first bad input. Safe to call from any thread."""
        return self.submit(calls.make_requests(self.context, inputs, params, options))

    def submit(self, requests: Sequence[PromptRequest]) -> list[Request]:
        """Engine requests for prepared ones (not yet queued: `core.add_requests` does).
        Prompt embeds, checked by the input stage as float arrays, become CPU tensors in the
        model dtype here: the one place they are rounded to it."""
        tasks = {name: get_task(name) for name in {r.params.task for r in requests}}
        return [
            Request(
                request_id=self.core.next_request_id(),
                prompt=r.prompt
                if r.prompt.prompt_embeds is None
                else self._in_model_dtype(r.prompt),
                params=r.params,
                task=tasks[r.params.task],
                user_data=r.index,
            )
            for r in requests
        ]

    def _in_model_dtype(self, prompt: Prompt) -> Prompt:
        embeds = prompt.prompt_embeds
        tensor = embeds if isinstance(embeds, torch.Tensor) else torch.from_numpy(embeds)
        return replace(prompt, prompt_embeds=tensor.to(device="cpu", dtype=self.dtype).contiguous())

    def _execute(
        self, requests: list[Request], desc: str, show_progress: bool | None
    ) -> list[PoolingOutput]:
        self.core.add_requests(requests)
        show = show_progress if show_progress is not None else len(requests) >= PROGRESS_THRESHOLD
        with tqdm(total=len(requests), disable=not show, desc=desc, unit="input") as bar:
            self.core.run_until_done(requests, on_progress=bar.update)
        heap.freeze_if_compiled()  # what compiling made lives as long as the engine
        return [outcome(r) for r in requests]

    def run_in_chunks(
        self,
        total: int,
        prepare: Callable[[int, int], PreparedCall[list[np.ndarray]]],  # inputs [start, stop)
        take: Callable[[int, list[np.ndarray]], object],  # (first input, a chunk's results)
        show_progress: bool | None,
        desc: str,
        weights: np.ndarray | None = None,  # [total] int64: texts each input counts as
    ) -> None:
        """Run a call of `total` inputs, its results to `take`: prepared and run at once up to
        `PIPELINE_CHUNK` inputs (counted by `weights`, each 1 if None: `chunk_starts`). A
        larger call runs chunk by chunk, the next chunk prepared on
        a worker thread (its texts tokenized by the `TokenizerPool`, if any) while the device
        runs the ones already queued. A chunk that is ready joins the queue as soon as a step's
        forward is queued (`EngineCore.step`'s `receive`), so that the next step is prepared,
        and this one pooled, while the device computes: short inputs fill a step with one
        chunk. Each chunk's results go to `take`, in order, as soon as the chunk is done.
        Errors name the input's index in the whole call; a failure cancels the call's queued
        requests."""
        starts = chunk_starts(total, weights)
        if len(starts) == 1:
            take(0, self.run(prepare(0, total), show_progress=show_progress, desc=desc))
            return
        chunks: list[tuple[int, PreparedCall[list[np.ndarray]], list[Request]]] = []
        done = [0]

        def count(_: Request) -> None:
            done[0] += 1

        show = show_progress if show_progress is not None else total >= PROGRESS_THRESHOLD
        stops = [*starts[1:], total]
        with (
            ThreadPoolExecutor(1, thread_name_prefix="vecpool-inputs") as worker,
            tqdm(total=total, disable=not show, desc=desc, unit="input") as bar,
        ):
            # The next chunks' preparations, in order: the worker runs them back to back.
            upcoming: deque[Future[PreparedCall[list[np.ndarray]]]] = deque()
            ahead = [1]  # chunks prepared ahead at most: PIPELINE_AHEAD once the engine ran dry

            def prepare_more(queued: int) -> None:
                """Start preparing the chunks after the first `queued` ones, up to `ahead`."""
                i = queued + len(upcoming)
                while i < len(starts) and len(upcoming) < ahead[0]:
                    upcoming.append(worker.submit(prepare, starts[i], stops[i]))
                    i += 1

            def queue_next(wait: bool = False) -> None:
                """Queue the next chunk's requests if it is prepared (or once it is, with
                `wait`), and start preparing the next ones (after the first chunk, with
                `PIPELINE_FIRST_ALONE`, once this is called as a step's `receive`)."""
                if not upcoming or not (wait or upcoming[0].done()):
                    prepare_more(len(chunks))
                    return
                start = starts[len(chunks)]
                try:
                    call = upcoming.popleft().result()
                except InputError as exc:
                    raise _shifted(exc, start) from None
                if chunks or not PIPELINE_FIRST_ALONE:
                    prepare_more(len(chunks) + 1)
                requests = self.submit(call.requests)
                if show:  # counted for the bar only
                    for request in requests:
                        request.add_done_callback(count)
                self.core.add_requests(requests)
                chunks.append((start, call, requests))

            def take_finished() -> None:
                """The results of the chunks done so far, in order, to `take`: while the device
                runs later chunks rather than all after the last step."""
                while taken[0] < len(chunks):
                    start, call, requests = chunks[taken[0]]
                    if not all(r.is_done for r in requests):
                        return
                    try:
                        take(start, call.finish([outcome(r) for r in requests]))
                    except InputError as exc:
                        raise _shifted(exc, start) from None
                    taken[0] += 1

            taken = [0]  # chunks whose results went to `take`
            try:
                while len(chunks) < len(starts):
                    # Every queued step is done and the next chunk was not queued in time:
                    # the device ran dry waiting for it (after a full chunk; the first, smaller
                    # one runs too briefly to tell). It may be ready by now, having missed the
                    # last step's `receive`: from here the worker prepares chunks back to back.
                    if len(chunks) >= 2 and not self.core.has_work():
                        ahead[0] = PIPELINE_AHEAD
                    if not upcoming:  # the first chunk; or a step failed before its `receive`
                        prepare_more(len(chunks))
                    queue_next(wait=True)
                    while self.core.has_work() and not (upcoming and upcoming[0].done()):
                        self.core.step(receive=queue_next)
                        take_finished()
                        bar.update(done[0] - bar.n)
                for _, _, requests in chunks:
                    self.core.run_until_done(requests)
                    take_finished()
                    bar.update(done[0] - bar.n)
            except BaseException:
                for future in upcoming:  # not waited for on the way out, if not yet begun
                    future.cancel()
                queued = [request for _, _, requests in chunks for request in requests]
                for request in queued:
                    request.cancel()
                try:
                    self.core.run_out(queued)
                except Exception:  # the call's own error is the one to raise
                    logger.exception("running out a failed call's requests raised")
                raise
        heap.freeze_if_compiled()  # what compiling made lives as long as the engine


def chunk_starts(total: int, weights: np.ndarray | None = None) -> list[int]:
    """Where each chunk of a call of `total` inputs starts: one chunk up to `PIPELINE_CHUNK`
    inputs in all, else a first of `PIPELINE_FIRST_CHUNK` and the others of `PIPELINE_CHUNK`,
    an input counting as its weight (`weights[i]` texts; each at least one input a chunk)."""
    if weights is None:
        if total <= PIPELINE_CHUNK:
            return [0]
        return [0, *range(PIPELINE_FIRST_CHUNK, total, PIPELINE_CHUNK)]
    ends = np.cumsum(weights)  # [total]: the weight up to and including each input
    if total == 0 or ends[-1] <= PIPELINE_CHUNK:
        return [0]
    starts, bound = [0], PIPELINE_FIRST_CHUNK
    while True:
        before = int(ends[starts[-1] - 1]) if starts[-1] else 0
        # The chunk ends after the last input within its bound (at least one input).
        stop = max(int(np.searchsorted(ends, before + bound, side="right")), starts[-1] + 1)
        if stop >= total:
            return starts
        starts.append(stop)
        bound = PIPELINE_CHUNK


def _shifted(error: InputError, offset: int) -> InputError:
    """`error` of a chunk's input, re-addressed to its index in the whole call."""
    return error.at(error.index + offset) if error.index is not None else error
