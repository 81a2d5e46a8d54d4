"""The engine loop: schedule, run, pool — and keep going whatever one request does."""

from __future__ import annotations

import itertools
import logging
import operator
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

import numpy as np
import torch

from vecpool.engine.request import Request
from vecpool.engine.scheduler import Scheduler, SchedulerOutput
from vecpool.errors import EngineError, RequestFailedError
from vecpool.runner.batch import FlatBatch
from vecpool.runner.model_runner import ModelRunner
from vecpool.runner.pooling_runner import PooledResult, PoolingRunner
from vecpool.runner.step import ScheduledChunk, StepInput

logger = logging.getLogger(__name__)
# A result is never NaN or infinite: such an output fails its request alone.
_NOT_FINITE = (
    "the model's output for this input is not finite (NaN or infinity): its values overflowed "
    "the model's dtype (e.g. prompt embeds of a far larger magnitude than the model's own)"
)
# An error that keeps recurring outside the model (scheduling, batch building, the loop's own
# bookkeeping): `guarded_step` waits this long after the first, doubling up to the cap, and
# the engine is unhealthy once this many came in a row (0.31 s of waiting in all).
LOOP_ERROR_DELAY = 0.01
LOOP_ERROR_MAX_DELAY = 1.0
UNHEALTHY_AFTER_LOOP_ERRORS = 5


@dataclass
class _InFlight:
    """A step whose forward is queued on the device, not yet pooled."""

    sched: SchedulerOutput
    batch: FlatBatch
    hidden: torch.Tensor  # [num_tokens, hidden]: the forward's output, on the device
    ready: torch.cuda.Event | None  # the end of the forward on the device (None: no CUDA)


class EngineCore:
    """Owns the scheduler and runners. Thread-safe: any thread may add requests or step."""

    def __init__(
        self,
        scheduler: Scheduler,
        model_runner: ModelRunner,
        pooling_runner: PoolingRunner,
        probe: ScheduledChunk | None = None,
    ):
        self.scheduler = scheduler
        self.model_runner = model_runner
        self.pooling_runner = pooling_runner
        # A short prompt known to run (the engine's own, built at start): after a step whose
        # every request failed alone too, it tells the input's fault from the engine's.
        self.probe = probe
        self._queue_lock = threading.Lock()  # guards the scheduler's queue
        self._step_lock = threading.Lock()  # one step at a time on the device
        self._ids = itertools.count()
        self.num_steps = 0  # steps that ran a batch
        self.last_step_tokens = 0  # tokens the last `step` computed (0: it only pooled)
        self.engine_at_fault = False  # the probe failed too; cleared by a step that computes
        self.loop_errors = 0  # errors in a row raised by `step` itself, outside the model
        # The next step, scheduled and built while the device runs the current one.
        self._prefetched: tuple[SchedulerOutput, FlatBatch] | None = None
        # A step whose forward is queued and whose pooling waits for the next step's call.
        self._in_flight: _InFlight | None = None
        # False: every step is pooled before the next one's forward is queued (the order
        # `benchmarks/lab/ab_run_ahead.py` compares against).
        self.run_ahead = True
        # Ids of requests that are done, whose runner state is freed once the step in flight
        # has pooled.
        self._releasable: list[str] = []
        # The steps the running `step` took (scheduled, prefetched, in flight): if it raises
        # outside the guarded regions, their requests that nothing else holds fail.
        self._taken: list[SchedulerOutput] = []

    @property
    def healthy(self) -> bool:
        """False once the engine is at fault: after a step whose every request failed alone,
        the probe failed too (true again after a step that computes anything); or `step`
        raised outside the model `UNHEALTHY_AFTER_LOOP_ERRORS` times in a row."""
        return not self.engine_at_fault and self.loop_errors < UNHEALTHY_AFTER_LOOP_ERRORS

    def guarded_step(self, receive: Callable[[], object] | None = None) -> int:
        """`step` for a loop that must outlive any one step: an error raised outside the model
        is logged, then waited out (`LOOP_ERROR_DELAY`, doubling to `LOOP_ERROR_MAX_DELAY`)
        rather than retried at once; `healthy` turns false once it keeps recurring."""
        try:
            ran = self.step(receive)
        except Exception:
            self.loop_errors += 1
            delay = min(LOOP_ERROR_DELAY * 2 ** (self.loop_errors - 1), LOOP_ERROR_MAX_DELAY)
            logger.exception(
                "engine step raised outside the model (%d in a row); retrying in %.2f s",
                self.loop_errors,
                delay,
            )
            time.sleep(delay)
            return 0
        self.loop_errors = 0
        return ran

    @property
    def prefix_cache_stats(self) -> tuple[int, int]:
        """Shared-prefix caching: (prompt tokens served from the cache, prompt tokens of the
        requests that looked it up); (0, 0) when it is off."""
        cache = self.scheduler.prefix_cache
        return (0, 0) if cache is None else (cache.hit_tokens, cache.queried_tokens)

    def next_request_id(self) -> str:
        return f"req-{next(self._ids)}"

    def add_requests(self, requests: list[Request]) -> None:
        """Queue one call's requests, longest first: steps of similar lengths waste less, and
        memory peaks early."""
        with self._queue_lock:
            for request in sorted(requests, key=_prompt_tokens, reverse=True):  # stable
                self.scheduler.add(request)

    def has_work(self) -> bool:
        with self._queue_lock:
            return (
                self._prefetched is not None
                or self._in_flight is not None
                or self.scheduler.has_work()
            )

    def run_out(self, requests: list[Request]) -> None:
        """Step until none of `requests` (done: a failed call's, cancelled) is queued or in a
        step any more, so that the call leaves nothing behind; other callers' requests ride
        along, as in `run_until_done`."""
        ids = {r.request_id for r in requests}
        while self._holds(ids):
            self.step()

    def _holds(self, ids: set[str]) -> bool:
        with self._queue_lock:
            queued = itertools.chain(
                self.scheduler.waiting,
                self.scheduler.held,
                self.scheduler.chunked,
                (r for sched in self._held_steps() for r in sched.requests),
            )
            return any(r.request_id in ids for r in queued)

    def _held_steps(self) -> list[SchedulerOutput]:
        """The steps that hold requests between calls of `step`: the prefetched one, the one
        in flight."""
        return [
            *([] if self._prefetched is None else [self._prefetched[0]]),
            *([] if self._in_flight is None else [self._in_flight.sched]),
        ]

    def step(self, receive: Callable[[], object] | None = None) -> int:
        """Run one step; return how many requests it ran (whole, or a chunk of their prompt).

        While the device computes this step, the next one is scheduled and its batch built,
        so the host's share of a step overlaps the device's. A step of whole prompts followed
        by another is pooled in the next call, after that step's forward is queued: the host
        then pools and finishes one step while the device runs the next. Once a step has
        pooled, the runners free what requests that are done kept between steps (a chunked
        prompt's keys, values and pooling state).

        `receive` is called once this step's forward is queued, before the next step is
        scheduled: a server that takes its requests between steps adds those that arrived
        meanwhile, so that the next step can be prepared (and this one pooled behind it).

        Should it raise outside the regions that recover a failed step (building a batch, the
        forward, pooling), the requests of the steps it took fail with an `EngineError` that
        names the error, unless a step still holds them, and the error goes on to the caller.
        """
        with self._step_lock, self.model_runner.on_device():
            self._taken = []
            try:
                return self._step(receive)
            except BaseException as exc:
                self._fail_taken(exc)
                raise

    def _step(self, receive: Callable[[], object] | None) -> int:
        """`step`'s body, under its locks; every step it takes goes into `_taken` first."""
        self.last_step_tokens = 0
        current = self._prefetched or self._prepare_next()
        self._prefetched = None
        if current is not None:
            self._taken.append(current[0])
            if any(r.is_done for r in current[0].requests):
                current = self._without_done(current)
                if current is not None:
                    self._taken.append(current[0])
        previous, self._in_flight = self._in_flight, None
        if previous is not None:
            self._taken.append(previous.sched)
        if current is None:
            if previous is None:
                self._release()
                return 0
            self._pool(previous)
            return len(previous.sched.requests)
        sched, batch = current
        self.num_steps += 1
        self.last_step_tokens = sched.step.num_batched_tokens
        try:
            hidden = self.model_runner.forward(batch)
        except Exception as exc:  # an engine failure must not take the engine down
            if previous is not None:
                self._pool(previous)
            self._recover(sched, exc)
            self._release(sched)
            return len(sched.requests)
        launched = _InFlight(sched, batch, hidden, self.pooling_runner.forward_done())
        if previous is not None:
            self._pool(previous)
        if receive is not None:
            try:
                receive()
            except BaseException:
                self._pool(launched)
                raise
        self._prefetched = self._prepare_next()
        upcoming = self._prefetched
        if (
            self.run_ahead
            and upcoming is not None
            and sched.step.independent
            and upcoming[0].step.independent
        ):
            self._in_flight = launched  # pooled once the next step's forward is queued
        else:
            self._pool(launched)
        return len(sched.requests)

    def _fail_taken(self, exc: BaseException) -> None:
        """`step` raised outside the guarded regions (batch building, forward, pooling): fail
        the requests of the steps it took that are not done and that no step still holds (the
        prefetched one, the one in flight), so that no caller waits for them for good."""
        held = {r.request_id for sched in self._held_steps() for r in sched.requests}
        lost = {
            r.request_id: r
            for sched in self._taken
            for r in sched.requests
            if not r.is_done and r.request_id not in held
        }
        self._taken = []
        if not lost:
            return
        logger.error(
            "engine step raised outside the model (%s: %s); failing its %d requests",
            type(exc).__name__,
            exc,
            len(lost),
        )
        error = EngineError(
            f"the engine step running this input failed outside the model: "
            f"{type(exc).__name__}: {exc}"
        )
        for request in lost.values():
            request.fail(error)
        self._releasable.extend(lost)

    def _pool(self, step: _InFlight) -> None:
        """Pool a step whose forward is queued, finish its requests, free what they kept."""
        try:
            results = self.pooling_runner.pool(
                step.hidden, step.batch, step.sched.step, after=step.ready
            )
        except Exception as exc:  # an engine failure must not take the engine down
            self._recover(step.sched, exc)
        else:
            self._finish(step.sched, results)
        self._release(step.sched)

    def _prepare_next(self) -> tuple[SchedulerOutput, FlatBatch] | None:
        """Schedule the next step and build its batch; None when nothing waits."""
        with self._queue_lock:
            sched = self.scheduler.schedule()
        self._releasable.extend(sched.released)
        if sched.is_empty:
            return None
        try:
            return sched, self.model_runner.prepare(sched.step)
        except Exception as exc:
            self._recover(sched, exc)
            self._releasable.extend(r.request_id for r in sched.requests)
            return None

    def _without_done(
        self, current: tuple[SchedulerOutput, FlatBatch]
    ) -> tuple[SchedulerOutput, FlatBatch] | None:
        """`current` without the requests that were cancelled or failed since it was built
        (a failed chunk leaves its prompt nothing to continue from); None if none is left."""
        sched = current[0]
        # A chunk that computes prefix blocks runs all the same: later chunks may read them.
        keep = [
            i
            for i, (r, c) in enumerate(zip(sched.requests, sched.step.chunks, strict=True))
            if not r.is_done or (c.blocks is not None and c.blocks.write_slots)
        ]
        if len(keep) == len(sched.requests):
            return current
        self._releasable.extend(
            sched.requests[i].request_id for i in set(range(len(sched.requests))) - set(keep)
        )
        if not keep:
            return None
        kept = SchedulerOutput(
            [sched.requests[i] for i in keep], StepInput([sched.step.chunks[i] for i in keep])
        )
        try:
            return kept, self.model_runner.prepare(kept.step)
        except Exception as exc:
            self._recover(kept, exc)
            self._releasable.extend(r.request_id for r in kept.requests)
            return None

    def _release(self, ran: SchedulerOutput | None = None) -> None:
        """Free the runner state of requests that are done: those of the step that ran (`ran`)
        that ran in chunks, and those the scheduler dropped. A request the prefetched step
        holds keeps its state until that step has run. (A whole prompt keeps nothing.)"""
        done = self._releasable
        if ran is not None:
            done += [
                r.request_id
                for r, c in zip(ran.requests, ran.step.chunks, strict=True)
                if r.is_done and not (c.start == 0 and c.ends_prompt)
            ]
        self._releasable = []
        if not done:
            return
        pending = [self._prefetched[0].step] if self._prefetched is not None else []
        if self._in_flight is not None:
            pending.append(self._in_flight.sched.step)
        if pending:
            in_flight = {c.request_id for step in pending for c in step.chunks}
            done = [i for i in done if i not in in_flight]
        self.model_runner.release(done)
        self.pooling_runner.release(done)

    def _finish(self, sched: SchedulerOutput, results: list[PooledResult]) -> None:
        self.engine_at_fault = False
        finite = _finite_outputs(results)
        for request, chunk, result, ok in zip(
            sched.requests, sched.step.chunks, results, finite, strict=True
        ):
            request.num_computed_tokens += chunk.num_tokens
            if result.error is not None:
                request.fail(result.error)
            elif not result.done:  # the prompt continues in a later step
                continue
            elif not ok or result.output is None:
                request.fail(RequestFailedError(_NOT_FINITE))
            else:
                request.finish(result.output)

    def _recover(self, sched: SchedulerOutput, exc: Exception) -> None:
        """A step failed: run its requests again in halves, so that only the ones that fail
        on their own fail (a bad input, or a batch too large for memory, costs nobody else).
        When every request fails alone too, the engine runs its probe before judging: the probe
        runs, so each input is at fault (`RequestFailedError`); the probe fails too, so the
        engine is (`EngineError`, and `healthy` turns false)."""
        num = len(sched.requests)
        logger.warning(
            "engine step of %d requests failed (%s: %s); isolating",
            num,
            type(exc).__name__,
            exc,
        )
        prefix_cache = self.scheduler.prefix_cache
        if prefix_cache is not None:  # blocks this step wrote are not to be read from now on
            prefix_cache.forget([r.request_id for r in sched.requests])
        failed = self._run_halves(sched, exc)
        budget = self.scheduler.config.max_num_batched_tokens
        # (a chunk of a longer prompt is within the budget: the step was not over it)
        over_budget = num == 1 and sched.step.chunks[0].num_tokens > budget
        # Requests whose images ran in a step's tower alone, over the patch budget.
        patch_budget = self.scheduler.config.patch_budget
        over_patches = {
            c.request_id: c.patches for c in sched.step.chunks if c.patches > patch_budget
        }
        engine_fault = None
        if len(failed) == num and not over_budget and not over_patches:
            engine_fault = self._probe_error()
            if engine_fault is not None:
                self.engine_at_fault = True
                logger.error(
                    "the engine's probe failed too (%s): the engine is at fault", engine_fault
                )
        for request, error in failed:
            reason = f"{type(error).__name__}: {error}"
            if over_budget:
                request.fail(
                    RequestFailedError(
                        f"this input of {request.num_prompt_tokens} tokens ran alone in a step "
                        f"over the token budget (max_num_batched_tokens={budget}), as a prompt "
                        f"that cannot run in chunks does, and failed: {reason}. To serve it, "
                        "truncate it (truncate_prompt_tokens), lower max_model_len, or give the "
                        "engine a device with more memory"
                    )
                )
            elif request.request_id in over_patches:
                request.fail(
                    RequestFailedError(
                        f"this input's images, {over_patches[request.request_id]} patch rows, "
                        "ran in a step whose vision tower ran no other input's, over the patch "
                        f"budget (max_num_batched_patches={patch_budget}), and failed: {reason}. "
                        "To serve it, give a smaller image (the image processor's max_pixels "
                        "bounds them) or a device with more memory"
                    )
                )
            elif engine_fault is not None:
                request.fail(
                    EngineError(
                        f"the engine step failed: {reason} (a known-good input fails too: "
                        f"{engine_fault})"
                    )
                )
            else:
                request.fail(RequestFailedError(f"the model failed on this input alone: {reason}"))

    def _probe_error(self) -> str | None:
        """Run the probe through the step's path (batch, forward, pooling): None if it gives a
        finite result, else what went wrong. No probe: every failure is the engine's."""
        if self.probe is None:
            return "the engine has no probe input"
        step = StepInput([self.probe])
        try:
            batch = self.model_runner.prepare(step)
            hidden = self.model_runner.forward(batch)
            (result,) = self.pooling_runner.pool(hidden, batch, step)
        except Exception as exc:
            return f"{type(exc).__name__}: {exc}"
        finally:
            self.model_runner.release([self.probe.request_id])
            self.pooling_runner.release([self.probe.request_id])
        if result.error is not None:
            return str(result.error)
        if result.output is None or not np.isfinite(result.output).all():
            return "its output is not finite"
        return None

    def _run_halves(
        self, sched: SchedulerOutput, exc: Exception
    ) -> list[tuple[Request, Exception]]:
        """Run `sched` (which failed as a whole with `exc`) in halves, finishing the requests
        that succeed; return those that fail alone, with their errors."""
        num = len(sched.requests)
        if num == 1:
            return [(sched.requests[0], exc)]
        failed: list[tuple[Request, Exception]] = []
        for part in (sched.part(0, num // 2), sched.part(num // 2, num)):
            try:
                batch = self.model_runner.prepare(part.step)
                hidden = self.model_runner.forward(batch)
                results = self.pooling_runner.pool(hidden, batch, part.step)
            except Exception as part_exc:
                failed.extend(self._run_halves(part, part_exc))
            else:
                self._finish(part, results)
        return failed

    def run_until_done(
        self, requests: list[Request], on_progress: Callable[[int], object] | None = None
    ) -> None:
        """Step until every one of `requests` is done; other callers' requests ride along."""
        remaining = deque(requests)
        while remaining:
            if not remaining[0].is_done:
                self.step()
            finished = 0
            while remaining and remaining[0].is_done:
                remaining.popleft()
                finished += 1
            if finished and on_progress is not None:
                on_progress(finished)


_prompt_tokens = operator.attrgetter("num_prompt_tokens")


def _finite_outputs(results: list[PooledResult]) -> list[bool]:
    """Whether each result has an output and every value of it is finite: one numpy call for
    a step whose outputs share a shape (one vector or score per sequence), else one each."""
    outputs = [r.output for r in results]
    arrays = [o for o in outputs if o is not None]
    shape = arrays[0].shape if arrays else ()
    if shape and len(arrays) == len(outputs) and all(a.shape == shape for a in arrays):
        # Joined along their first axis, in order: a third of `np.stack`'s cost.
        joined = np.concatenate(arrays).reshape(len(arrays), arrays[0].size)
        rows = cast(np.ndarray, np.isfinite(joined).all(axis=1))
        return [bool(ok) for ok in rows]
    return [o is not None and bool(np.isfinite(o).all()) for o in outputs]
