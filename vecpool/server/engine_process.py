"""The engine process: one `Engine`, fed by the API-server processes over a ZeroMQ socket.

Its loop is single-threaded, so nothing contends with the model for the interpreter: receive
every message that arrived (ZeroMQ's own I/O thread, outside Python, buffers them while a step
runs), step with everything queued, send each API process the calls that finished. A step
takes what arrived once its forward is queued: with more to run on a GPU, the next step is
prepared and launched before this one is pooled, so that the device computes while the host
pools, replies and receives (`EngineCore.step`); on the CPU, where the forward has run when it
returns, each step is pooled and answered before the next one's forward. When the engine was idle and a call arrives, it
takes more while they keep coming, up to `batch_wait` seconds (or a step's worth) before it
steps: a step that starts with one request runs with one request, while the others of a burst
are a millisecond behind.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import signal
import sys
import time
from collections import defaultdict
from dataclasses import dataclass
from multiprocessing.connection import Connection

import zmq

from vecpool.api import Engine, EngineArgs, heap
from vecpool.api.admission import Admission
from vecpool.api.outputs import outcome
from vecpool.api.running import use_thread_lock_for_bars
from vecpool.engine.request import Request, RequestStatus
from vecpool.errors import VecpoolError
from vecpool.server import wire
from vecpool.server.config import EngineProcessConfig
from vecpool.server.metrics import EngineMetrics

logger = logging.getLogger(__name__)
# While an idle engine gathers a step, a pause this long in arrivals ends the wait: one client
# alone waits this much, many clients keep adding to the step up to `batch_wait`.
GATHER_GAP = 0.001
# As plain ints: pyzmq's enum members cost a conversion at each use, and these are used for
# every message.
_EVENTS, _POLLIN, _NOBLOCK = int(zmq.EVENTS), int(zmq.POLLIN), int(zmq.NOBLOCK)
_SNDMORE = int(zmq.SNDMORE)


@dataclass(eq=False)
class _Call:
    """One API call in the engine: its requests, and when its first step started."""

    identity: bytes  # the API process that sent it
    call_id: int
    requests: list[Request]
    arrived: float
    remaining: int = 0
    first_step: float = math.inf
    last_done: float = 0.0
    cancelled: bool = False


class EngineLoop:
    """Serves one engine to the API processes connected to `config.address`."""

    def __init__(self, engine: Engine, config: EngineProcessConfig, metrics: EngineMetrics | None):
        self.engine = engine
        self.config = config
        self.metrics = metrics
        self.context = zmq.Context()
        self.socket = self.context.socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.SNDHWM, 0)  # never drop a reply; admission bounds the queue
        self.socket.setsockopt(zmq.RCVHWM, 0)
        self.socket.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a reply to a gone process raises
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.bind(config.address)
        self.calls: dict[tuple[bytes, int], _Call] = {}
        self.admission = Admission(max_queued=config.max_queued, max_wait=config.max_wait)
        self.arrived_tokens = 0  # tokens that arrived since the last step started
        self.outbox: dict[bytes, list[wire.CallDone | wire.CallRefused]] = defaultdict(list)
        self.step_started = 0.0
        info = engine.info()
        self.step_tokens, self.step_requests = info.max_num_batched_tokens, info.max_num_seqs
        # On the CPU a step's forward has run when it returns, and nothing computes while the
        # host pools: pooling a step behind the next one's forward (run-ahead, which on a GPU
        # keeps the device busy meanwhile) would only hold its replies back by that forward,
        # and split a closed loop of clients into three groups of smaller steps, not two.
        engine.core.run_ahead = engine.core.model_runner.device.type != "cpu"

    def run(self, parent: Connection | None = None) -> bool:
        """Serve until `parent` (a pipe whose other end the parent holds) closes (True), or
        until the engine is unhealthy (False)."""
        poller = zmq.Poller()
        poller.register(self.socket, zmq.POLLIN)
        if parent is not None:
            poller.register(parent.fileno(), zmq.POLLIN)
        core = self.engine.core
        while True:
            idle = not core.has_work()
            events = dict(poller.poll(None if idle else 0))
            if parent is not None and parent.fileno() in events:
                return True  # the parent is gone (or closed the pipe to stop us)
            arrived = self._receive()
            if idle and arrived and self.config.batch_wait > 0:
                self._gather(poller, time.perf_counter() + self.config.batch_wait)
            if arrived and self.metrics is not None:
                self.metrics.set_queue_size(self.admission.queued)
            if core.has_work():
                self._step()
            self._flush()
            if not core.healthy:  # exiting fails every call in flight and turns /health to 503
                logger.error(
                    "the engine is at fault (a known-good input failed too, or its steps keep "
                    "raising outside the model); exiting"
                )
                return False

    def close(self) -> None:
        self.socket.close(linger=0)
        self.context.term()

    # ---- receiving ---------------------------------------------------------------------

    def _receive(self) -> bool:
        """Take every message waiting; whether a call with work arrived."""
        arrived = False
        socket = self.socket
        # Asked once: a receive that finds nothing raises, which costs more than asking when
        # nothing waits; but asking before every message costs more than the one raise that
        # ends a run of them.
        if not socket.getsockopt(_EVENTS) & _POLLIN:  # type: ignore[operator]
            return False
        while True:
            # An API process's DEALER sends one frame, which the ROUTER prefixes with its
            # identity: two receives, cheaper than `recv_multipart`'s loop. A message is
            # delivered whole, so the second frame is there once the first is.
            try:
                identity = socket.recv(_NOBLOCK)
            except zmq.Again:
                return arrived
            payload = socket.recv(_NOBLOCK)
            message = wire.to_engine.decode(payload)
            if isinstance(message, wire.Submit):
                arrived |= self._submit(identity, message)
            else:
                self._cancel(identity, message.call_id)

    def _gather(self, poller: zmq.Poller, deadline: float) -> None:
        """Take more calls while they keep coming (each within `GATHER_GAP` of the last),
        until `deadline` or until a step's worth has arrived."""
        while self.arrived_tokens < self.step_tokens and self.admission.queued < self.step_requests:
            left = deadline - time.perf_counter()
            if left <= 0:
                return
            timeout = math.ceil(min(left, GATHER_GAP) * 1000)  # zmq_poll counts milliseconds
            if self.socket in dict(poller.poll(timeout)):
                self._receive()
            else:
                return  # a pause in arrivals (or the parent closed: the loop will see it)

    def _submit(self, identity: bytes, message: wire.Submit) -> bool:
        n = len(message.requests)
        requests = self.engine.submit(wire.prompt_requests(message))
        tokens = sum(r.num_prompt_tokens for r in requests)
        reason = self.admission.refusal(n, tokens)
        if reason is not None:
            self.outbox[identity].append(wire.CallRefused(message.call_id, reason))
            return False
        call = _Call(identity, message.call_id, requests, time.perf_counter(), remaining=n)
        self.calls[(identity, message.call_id)] = call
        self.admission.add(n, tokens)
        on_done = functools.partial(self._on_done, call)
        for request in requests:
            self.arrived_tokens += request.num_prompt_tokens
            request.add_done_callback(on_done)
        self.engine.core.add_requests(requests)
        if not requests:  # an empty call (a health check's) is done at once
            self._reply(call)
        return bool(requests)

    def _cancel(self, identity: bytes, call_id: int) -> None:
        call = self.calls.get((identity, call_id))
        if call is not None:
            call.cancelled = True
            for request in call.requests:
                request.cancel()

    # ---- stepping and replying ---------------------------------------------------------

    def _step(self) -> None:
        self.step_started = time.perf_counter()
        self.arrived_tokens = 0
        # The loop must outlive any one step. What arrived while the step's forward was being
        # queued is taken before the next step is scheduled: that step can then be prepared,
        # and this one pooled behind it (`EngineCore.step`).
        ran = self.engine.core.guarded_step(self._between_steps)
        if ran:
            elapsed = time.perf_counter() - self.step_started
            self.admission.on_step(elapsed, self.engine.core.last_step_tokens)
        if ran and self.metrics is not None:
            self.metrics.on_step(self.step_started, time.perf_counter())
        heap.freeze_if_compiled()  # a step's compiled code lives as long as the process

    def _between_steps(self) -> None:
        """Once a step's forward is queued and the step before it has pooled: that step's
        replies go out now rather than after the next step is scheduled and built (a
        request's answer sooner by that host time), then what arrived is taken."""
        if self.outbox:
            self._flush()
        self._receive()

    def _on_done(self, call: _Call, request: Request) -> None:
        """A request of `call` is done (in a step, or cancelled)."""
        if self.metrics is not None:
            self.metrics.on_request_done(request)
        ran = request.status in (RequestStatus.FINISHED, RequestStatus.FAILED)
        self.admission.done(request.num_prompt_tokens)
        if ran:
            call.first_step = min(call.first_step, self.step_started)
            call.last_done = time.perf_counter()
        call.remaining -= 1
        if call.remaining == 0:
            self._reply(call)

    def _reply(self, call: _Call) -> None:
        del self.calls[(call.identity, call.call_id)]
        if call.cancelled:  # nobody waits for it
            return
        outputs = [wire.wire_output(outcome(r)) for r in call.requests]
        ran = call.last_done > 0
        queue = call.first_step - call.arrived if ran else 0.0
        inference = call.last_done - call.first_step if ran else 0.0
        self.outbox[call.identity].append(
            wire.CallDone(call.call_id, outputs, max(queue, 0.0), inference)
        )

    def _flush(self) -> None:
        queued, wait = self.admission.queued, self.admission.expected_wait()
        if self.metrics is not None:
            self.metrics.set_queue_size(queued)
            self.metrics.set_admission(wait, self.admission.tokens_per_second)
        for identity, calls in self.outbox.items():
            try:
                # Two sends rather than `send_multipart`'s loop; a gone process fails the first.
                self.socket.send(identity, _SNDMORE)
                self.socket.send(wire.encoder.encode(wire.Replies(queued, calls, wait)))
            except zmq.ZMQError as exc:  # that API process is gone
                logger.warning("dropping %d replies to a gone API process: %s", len(calls), exc)
        self.outbox.clear()


def run_engine_process(
    engine_args: EngineArgs,
    config: EngineProcessConfig,
    ready: Connection,
    parent: Connection,
    engine_alive: Connection,
    *,
    log_level: str = "info",
    threads: int | None = None,
    tag: str = "engine",
) -> None:
    """The engine process's entry point: load the engine, report `("ready", EngineInfo)` (or
    `("invalid", message)` for a bad setting or folder, `("error", message)` for anything
    else) on `ready`, then serve until the parent goes away. `engine_alive`
    is held, never written: its readers see it close when this process exits, however.
    `threads`: the CPU threads torch may use (engines sharing a machine's cores); `tag`
    prefixes its log lines."""
    # Ctrl-C reaches every process of the group: the supervisor stops the API processes
    # first (they drain their connections), then this one.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(
        level=log_level.upper(), format=f"%(levelname)s:     [{tag}] %(name)s: %(message)s"
    )
    apply_threads(threads)
    use_thread_lock_for_bars()
    try:
        engine = Engine.from_args(engine_args)
        metrics = None
        if config.metrics:
            from prometheus_client import CollectorRegistry

            metrics = EngineMetrics(CollectorRegistry(), model=config.model)
            metrics.follow_prefix_cache(engine.core)
        loop = EngineLoop(engine, config, metrics)
    except VecpoolError as exc:  # a setting or the model folder: the user's to fix
        ready.send(("invalid", str(exc)))
        ready.close()
        return
    except Exception as exc:
        ready.send(("error", f"{type(exc).__name__}: {exc}"))
        ready.close()
        return
    ready.send(("ready", engine.info()))
    ready.close()
    # What start-up made (the model, compiled code, graphs) lives as long as the process: kept
    # out of the collector's full passes, which otherwise walk it all and stall a step.
    heap.freeze()
    try:
        served = loop.run(parent)
    finally:
        loop.close()
        engine_alive.close()
    if not served:  # a non-zero status: the supervisor restarts an engine at fault
        sys.exit(1)


def apply_threads(threads: int | None) -> None:
    """Hold this process's torch to `threads` compute threads and one inter-op thread (None:
    leave torch as it is). Call before any work."""
    if threads is None:
        return
    import torch

    torch.set_num_threads(threads)
    with contextlib.suppress(RuntimeError):  # only settable before the first inter-op work
        torch.set_num_interop_threads(1)
