"""The API process's side of the engine process: an `EngineClient` over a ZeroMQ socket.

`run` sends a call's prepared requests and awaits its reply; cancelling it (a client that went
away) tells the engine to drop them. A pipe whose only writer is the engine process tells the
client at once when that process exits: every call in flight then fails with
`EngineDeadError`, the socket is closed (what it still held for the lost process is dropped),
and `is_running` turns false (so `/health` answers 503) until the supervisor hands over the
restarted process (`restarted`: its generation and its own alive pipe), which the client reaches
on a fresh socket. Nothing of the old process can reach the new one's calls: its socket is gone,
and call ids are never reused.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Sequence
from multiprocessing.connection import Connection

import zmq
import zmq.asyncio

from vecpool.calls.outputs import PoolingOutput, PromptRequest, RunTimes
from vecpool.errors import EngineDeadError, QueueFullError
from vecpool.server import wire

logger = logging.getLogger(__name__)

# Seconds after its last reply that an engine's word on its queue is acted on by a process
# with no call of its own there (`EngineProcessClient.expected_wait`).
STALE_WAIT = 1.0
# A health check asks the engine process itself once it has said nothing for HEALTH_FRESH
# seconds (an engine answering calls needs no question), and fails when the answer takes
# longer than HEALTH_WAIT: the engine takes a call between two steps, so only a step of that
# length, or an engine stopped, hung in a device call or deadlocked, leaves it unanswered.
HEALTH_FRESH = 1.0
HEALTH_WAIT = 5.0


class EngineProcessClient:
    """Runs requests on the engine process at `address`. `start()` inside the event loop
    that will use it; `close()` at exit."""

    def __init__(
        self,
        address: str,
        engine_alive: Connection | None,
        *,
        max_queued: int,
        name: str = "the engine process",
    ):
        self.address = address
        self.name = name  # in errors and logs, e.g. "engine process 1 (cuda:1)"
        self.max_queued = max_queued
        self._engine_alive = engine_alive
        self._ids = itertools.count()
        self._pending: dict[int, asyncio.Future[wire.CallDone | wire.CallRefused]] = {}
        self._in_flight = 0  # requests of this process's calls not yet answered
        self._engine_queued = 0  # the engine's queue, all API processes, at its last reply
        self._engine_wait = 0.0  # seconds of work the engine had queued at its last reply
        self._engine_wait_at = 0.0  # when that reply came (time.monotonic())
        self._context: zmq.asyncio.Context | None = None
        self._socket: zmq.asyncio.Socket | None = None
        self._reader: asyncio.Task[None] | None = None
        self._probe: asyncio.Future[str | None] | None = None  # a health check's question
        self._dead = False  # the process exited; until a restarted one is handed over
        self.generation = 0  # which process of this engine: +1 with each restart

    async def start(self) -> None:
        self._context = zmq.asyncio.Context()
        self._connect()

    async def close(self) -> None:
        reader = self._reader
        self._disconnect()
        if reader is not None:
            await asyncio.gather(reader, return_exceptions=True)
        if self._engine_alive is not None:
            self._engine_alive.close()
        if self._context is not None:
            self._context.term()

    def _connect(self) -> None:
        """A fresh socket to the engine process, and a watch on its alive pipe."""
        assert self._context is not None
        socket = self._context.socket(zmq.DEALER)
        socket.setsockopt(zmq.SNDHWM, 0)
        socket.setsockopt(zmq.RCVHWM, 0)
        socket.setsockopt(zmq.LINGER, 0)
        socket.connect(self.address)
        self._socket = socket
        self._reader = asyncio.create_task(self._read_replies(socket))
        if self._engine_alive is not None:
            loop = asyncio.get_running_loop()
            loop.add_reader(self._engine_alive.fileno(), self._on_engine_exit)

    def _disconnect(self) -> None:
        """Close the socket (dropping whatever it holds), stop reading it and the alive pipe."""
        if self._engine_alive is not None and not self._engine_alive.closed:
            asyncio.get_running_loop().remove_reader(self._engine_alive.fileno())
        if self._reader is not None:
            self._reader.cancel()
            self._reader = None
        if self._socket is not None:
            self._socket.close(linger=0)
            self._socket = None

    @property
    def num_queued(self) -> int:
        # The engine's count is from the last reply, which only a call of ours brings: with
        # none pending it may be long stale, and only our own count is known.
        return max(self._in_flight, self._engine_queued) if self._pending else self._in_flight

    @property
    def expected_wait(self) -> float:
        """Seconds of work the engine has queued, as of its last reply, less the time since:
        the engine works it off meanwhile (an estimate; the engine decides exactly).

        Only a call of ours brings a reply. With none pending and the last reply older than
        `STALE_WAIT`, the word is not acted on (0): the next call goes to the engine, whose
        admission decides and whose reply brings a fresh word. Otherwise a process could
        keep refusing on a wait the engine misjudged once, never asking the engine again (an
        H200 refused calls as "about 77.6 s of work" while the engine's own estimate, polled
        every 50 ms, stayed under 0.75 s)."""
        since = time.monotonic() - self._engine_wait_at
        if not self._pending and since > STALE_WAIT:
            return 0.0
        return max(0.0, self._engine_wait - since)

    @property
    def is_running(self) -> bool:
        return self._socket is not None and not self._dead

    @property
    def health_problem(self) -> str | None:
        """Why a health check should fail (the engine process exited), or None."""
        if self._dead:
            return f"{self.name} exited; restarting"
        return None if self._socket is not None else f"{self.name} is not connected"

    async def health(self) -> str | None:
        """`health_problem`, or, where the engine process has said nothing for `HEALTH_FRESH`
        seconds, what an empty call shows: answered (refused too) within `HEALTH_WAIT`
        seconds, None; else the engine is stuck though its process lives. Checks at once
        share one question."""
        problem = self.health_problem
        if problem is not None or time.monotonic() - self._engine_wait_at < HEALTH_FRESH:
            return problem
        if self._probe is None or self._probe.done():
            self._probe = asyncio.ensure_future(self._ask())
        return await asyncio.shield(self._probe)

    async def _ask(self) -> str | None:
        try:
            await asyncio.wait_for(self.run([]), HEALTH_WAIT)
        except QueueFullError:  # an answer all the same
            pass
        except TimeoutError:
            return f"{self.name} did not answer within {HEALTH_WAIT:g} s; it may be stuck"
        except EngineDeadError:
            return self.health_problem or f"{self.name} exited"
        return None

    def restarted(self, generation: int, engine_alive: Connection) -> None:
        """The supervisor's word (in the event loop) that the engine's process `generation`
        has loaded and serves; `engine_alive`: that process's alive pipe. A hand-over of a
        generation not newer than the current one is ignored."""
        if generation <= self.generation:
            engine_alive.close()
            return
        if not self._dead:  # the old process's exit, not yet seen on its pipe
            self._lose()
        if self._engine_alive is not None:
            self._engine_alive.close()
        self._engine_alive = engine_alive
        self.generation = generation
        self._engine_queued, self._engine_wait = 0, 0.0
        self._connect()
        self._dead = False
        logger.info("%s is back (generation %d)", self.name, generation)

    async def run(
        self, requests: Sequence[PromptRequest], times: RunTimes | None = None
    ) -> list[PoolingOutput]:
        """Run `requests` on the engine; their outputs in order. `QueueFullError` when the
        engine's queue cannot take them, `EngineDeadError` when the engine process is gone."""
        if self._dead:
            raise EngineDeadError(f"{self.name} exited; restarting")
        if self._socket is None:
            raise EngineDeadError(f"{self.name} is not running")
        call_id = next(self._ids)
        future: asyncio.Future[wire.CallDone | wire.CallRefused] = (
            asyncio.get_running_loop().create_future()
        )
        self._pending[call_id] = future
        n = len(requests)
        self._in_flight += n
        start = time.perf_counter()
        socket = self._socket
        try:
            await socket.send(wire.encoder.encode(wire.submit(call_id, list(requests))))
            reply = await future
        except asyncio.CancelledError:
            # Still pending: the process that has the call still runs, on this socket.
            if self._pending.pop(call_id, None) is not None and self._socket is socket:
                socket.send(wire.encoder.encode(wire.Cancel(call_id)), zmq.NOBLOCK)
            raise
        finally:
            self._in_flight -= n
        if isinstance(reply, wire.CallRefused):
            raise QueueFullError(reply.reason)
        if times is not None:
            times.inference = reply.inference
            times.queue = max(0.0, time.perf_counter() - start - reply.inference)
        return [wire.pooling_output(o) for o in reply.outputs]

    async def _read_replies(self, socket: zmq.asyncio.Socket) -> None:
        while True:
            message = wire.replies.decode(await socket.recv())
            self._engine_queued, self._engine_wait = message.queued, message.wait
            self._engine_wait_at = time.monotonic()
            for reply in message.calls:
                future = self._pending.pop(reply.call_id, None)
                if future is not None and not future.done():
                    future.set_result(reply)

    def _on_engine_exit(self) -> None:
        """The engine process closed its end of the pipe: it exited."""
        assert self._engine_alive is not None
        if self._engine_alive.poll():  # else woken without EOF (never written): still running
            self._lose()

    def _lose(self) -> None:
        """The engine process is gone: fail its calls in flight, drop its socket."""
        self._disconnect()
        self._dead = True
        self._engine_queued, self._engine_wait = 0, 0.0
        logger.error("%s exited; %d calls in flight fail", self.name, len(self._pending))
        for future in self._pending.values():
            if not future.done():
                future.set_exception(EngineDeadError(f"{self.name} exited"))
        self._pending.clear()
