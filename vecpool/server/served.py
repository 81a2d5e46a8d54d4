"""Several models behind one server: an API process's client of every model's engines.

`vecpool serve A B` runs one engine process (or data-parallel group) per model behind the same
API processes. Each API process holds one `EngineGroupClient` per model, in the models' order,
and this client over them all:

- a route runs its call on the group of the model its `model` field names
  (`ServerState.for_model`); calls that name no model run here, on the first model's group;
- what is asked of the server as a whole reads every group: it runs while any model's engine
  runs; `/health` fails naming each engine process gone (and, with several models, its
  model); the wait a new call faces is the least loaded model's (the server cannot tell,
  before reading a body, which model it is for);
- the supervisor's hand-overs of restarted engine processes arrive here, on this process's
  control pipe: ("engine", model, rank, generation), then the new process's alive pipe (a file
  descriptor, `recv_handle`), passed to that model's engine client.

One model is the case N = 1 of the same code.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence
from multiprocessing.connection import Connection
from multiprocessing.reduction import recv_handle

from vecpool.calls.outputs import PoolingOutput, PromptRequest, RunTimes
from vecpool.server.engine_group import RESTART_RETRY_AFTER, EngineGroupClient


class ServedModelsClient:
    """The server's engines, one `EngineGroupClient` per model (`groups`, in the models'
    order; the first is the default). `start()` inside the event loop that will use it;
    `close()` at exit. `control`: the supervisor's pipe of hand-overs, if any."""

    def __init__(self, groups: Sequence[EngineGroupClient], *, control: Connection | None = None):
        if not groups:
            raise ValueError("a server needs at least one model")
        self.groups = list(groups)
        self.default = self.groups[0]
        self.max_queued = self.default.max_queued
        self._control = control

    async def start(self) -> None:
        for group in self.groups:
            await group.start()
        if self._control is not None:
            loop = asyncio.get_running_loop()
            threading.Thread(
                target=self._watch_control, args=(loop,), name="vecpool-handovers", daemon=True
            ).start()

    async def close(self) -> None:
        for group in self.groups:
            await group.close()

    def _watch_control(self, loop: asyncio.AbstractEventLoop) -> None:
        """Take the supervisor's hand-overs, each ("engine", model, rank, generation) and then
        the alive pipe's descriptor, and pass them to the event loop; until the supervisor is
        gone. A thread of its own: the reads block, and the event loop must never wait on them."""
        control = self._control
        assert control is not None
        while True:
            try:
                _, model, rank, generation = control.recv()
                alive = Connection(recv_handle(control), writable=False)
            except (EOFError, OSError):  # the supervisor is gone: this process is stopping
                return
            engine = self.groups[model].engines[rank]
            try:
                loop.call_soon_threadsafe(engine.restarted, generation, alive)
            except RuntimeError:  # the event loop has closed: nothing to hand it to
                alive.close()
                return

    # ---- the default model's queue: where a call that names no model runs ----------------

    @property
    def num_queued(self) -> int:
        return self.default.num_queued

    async def run(
        self, requests: Sequence[PromptRequest], times: RunTimes | None = None
    ) -> list[PoolingOutput]:
        """Run `requests` on the default model's engines (`EngineGroupClient.run`)."""
        return await self.default.run(requests, times)

    # ---- the server as a whole ------------------------------------------------------------

    @property
    def expected_wait(self) -> float:
        """The least loaded running model's queued seconds: a new call, its model not yet
        read, is refused only when it would wait that long whichever model it names."""
        waits = [g.expected_wait for g in self.groups if g.is_running]
        return min(waits) if waits else 0.0

    @property
    def is_running(self) -> bool:
        return any(g.is_running for g in self.groups)

    @property
    def retry_after(self) -> float | None:
        """Seconds a refused call should wait while no engine of any model runs; None while
        one does (a call for a model whose engines are all gone gets its own 503)."""
        return None if self.is_running else RESTART_RETRY_AFTER

    @property
    def health_problem(self) -> str | None:
        """Each model's lost engine processes (their names say the model, where several are
        served), or None while every engine runs."""
        problems = [p for g in self.groups if (p := g.health_problem) is not None]
        return "; ".join(problems) if problems else None

    async def health(self) -> str | None:
        """`health_problem`, each model's engines asked where they have said nothing lately."""
        answers = await asyncio.gather(*(g.health() for g in self.groups))
        problems = [p for p in answers if p is not None]
        return "; ".join(problems) if problems else None
