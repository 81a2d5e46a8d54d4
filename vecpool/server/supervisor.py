"""The supervisor's watch over the server's processes: it restarts a lost engine process.

An engine process that exits while the server runs (killed, crashed, or at fault: it then exits
itself with status 1) is started again on the same device and the same ipc address, after a
back-off: `RESTART_DELAY` seconds, doubling with each restart of that engine within the
window, up to `RESTART_MAX_DELAY`. Once it has loaded, each API process is handed, on its
control pipe, the engine's model (its index among the served models), rank and generation and
the new process's "alive" pipe (the file descriptor itself, `send_handle`): it then connects to
the new process with a fresh socket (`EngineProcessClient.restarted`). With several models
served, a lost engine of one is restarted while the others serve on. More than `max_restarts`
restarts within `window` seconds (every engine of the server counted together) stop the
server, exit status 1: whatever keeps failing is the orchestrator's to handle (another
machine, a page to a person).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from multiprocessing.reduction import send_handle
from types import FrameType
from typing import Any

from vecpool.calls import EngineInfo

logger = logging.getLogger("vecpool.server")

# Seconds before the first restart of an engine process; each restart of the same engine within
# the window doubles it, up to the cap.
RESTART_DELAY = 0.5
RESTART_MAX_DELAY = 30.0
# Seconds to wait for processes to stop on their own (past any drain) before they are killed.
STOP_SECONDS = 5

# Starts an engine process: (process, reader of its alive pipe, reader of its ready pipe).
Spawn = Callable[[], tuple[BaseProcess, Connection, Connection]]


@dataclass
class EngineProcess:
    """One engine process of the server, as the supervisor holds it, across its restarts."""

    rank: int  # within its model's data-parallel group
    name: str  # in logs and errors: "the engine process", or "engine process 1 (cuda:1)"
    address: str  # where it listens, e.g. "ipc:///tmp/.../engine-0"; the same after a restart
    spawn: Spawn
    process: BaseProcess
    alive: Connection | None  # the reader of its alive pipe, until handed to the API processes
    ready: Connection | None  # while it loads: the pipe it reports on
    generation: int = 0  # 0 for the first process of this rank, +1 each restart
    restart_at: float | None = None  # while it waits out the back-off (time.monotonic())
    model: int = 0  # which served model it runs (an index, in the order they were given)

    @property
    def loading(self) -> bool:
        return self.ready is not None


def wait_ready(engine: BaseProcess, ready: Connection) -> EngineInfo | tuple[int, str]:
    """The engine's info once it has loaded, or (exit status, why): 2 for a bad setting or model
    folder, 1 for any other failure. Blocks until the engine reports or exits."""
    try:
        status, value = ready.recv()
    except EOFError:
        engine.join()
        return 1, f"the engine process exited ({engine.exitcode})"
    finally:
        ready.close()
    if status != "ready":
        engine.join()
        return (2 if status == "invalid" else 1), str(value)
    assert isinstance(value, EngineInfo)
    return value


@dataclass
class RestartPolicy:
    """At most `max_restarts` restarts within `window` seconds, all engines together; each
    engine's back-off doubles with its own restarts in the window."""

    max_restarts: int
    window: float
    restarts: deque[tuple[float, Hashable]] = field(default_factory=deque)  # (when, engine)

    def delay(self, engine: Hashable, now: float) -> float | None:
        """Seconds before `engine` (a key naming one engine: (model, rank)), lost now,
        restarts; None when the limit is spent."""
        while self.restarts and now - self.restarts[0][0] > self.window:
            self.restarts.popleft()
        if len(self.restarts) >= self.max_restarts:
            return None
        self.restarts.append((now, engine))
        mine = sum(1 for _, e in self.restarts if e == engine)
        return float(min(RESTART_MAX_DELAY, RESTART_DELAY * 2 ** (mine - 1)))


class Supervisor:
    """Watches the engine and API processes until a signal (SIGINT, SIGTERM), until every API
    process has exited, or until the engines have been restarted too often; then stops them."""

    def __init__(
        self,
        engines: Sequence[EngineProcess],
        apis: Sequence[BaseProcess],
        controls: Sequence[Connection],
        policy: RestartPolicy,
        *,
        grace: float,
        on_restart: Callable[[EngineProcess], Any] | None = None,
    ):
        self.engines = engines
        self.apis = apis
        self.controls = controls  # one per API process (index for index): hand-overs
        self.policy = policy
        self.grace = grace
        self.on_restart = on_restart  # called with each engine back in service
        self.stopping = threading.Event()

    def run(self) -> int:
        """Supervise until stopped; the exit status (0 when stopped by a signal)."""

        def on_signal(signum: int, frame: FrameType | None) -> None:
            self.stopping.set()

        previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            return self._watch()
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)
            stop(self.apis, self.grace + STOP_SECONDS)  # they drain their requests, on the engines
            stop([e.process for e in self.engines], STOP_SECONDS)
            for e in self.engines:
                for pipe in (e.alive, e.ready):
                    if pipe is not None:
                        pipe.close()

    def _watch(self) -> int:
        while not self.stopping.is_set():
            now = time.monotonic()
            due = [e.restart_at - now for e in self.engines if e.restart_at is not None]
            timeout = max(0.0, min([0.5, *due]))
            waited: list[Any] = [p.sentinel for p in self._running()]
            waited += [e.ready for e in self.engines if e.ready is not None]
            wait(waited, timeout=timeout)
            if self.stopping.is_set():  # engines the signal stopped too are not restarted
                break
            for e in self.engines:
                if not self._tend(e):
                    return 1
            if all(api.exitcode is not None for api in self.apis):
                logger.error("every API-server process has exited; stopping")
                return 1
        return 0

    def _running(self) -> list[BaseProcess]:
        live = [e.process for e in self.engines if e.restart_at is None]
        return [p for p in (*live, *self.apis) if p.exitcode is None]

    def _tend(self, e: EngineProcess) -> bool:
        """Move engine `e` along (lost, waiting, loading, serving); False to stop the server."""
        if e.restart_at is not None:
            if time.monotonic() >= e.restart_at:
                e.restart_at = None
                e.generation += 1
                e.process, e.alive, e.ready = e.spawn()
                logger.info("%s restarting (pid %s), loading the model", e.name, e.process.pid)
            return True
        if e.ready is not None:
            if not e.ready.poll():
                return True
            result = wait_ready(e.process, e.ready)
            e.ready = None
            if isinstance(result, EngineInfo):
                self._hand_over(e)
                return True
            return self._lost(e, f"failed to restart: {result[1]}")
        if e.process.exitcode is None:
            return True
        return self._lost(e, f"exited ({e.process.exitcode})")

    def _lost(self, e: EngineProcess, what: str) -> bool:
        e.process.join()
        if e.alive is not None:
            e.alive.close()
            e.alive = None
        delay = self.policy.delay((e.model, e.rank), time.monotonic())
        if delay is None:
            logger.error(
                "%s %s: %d restarts within %g s (--max-engine-restarts, --engine-restart-window); "
                "stopping the server for its orchestrator to take over",
                e.name,
                what,
                self.policy.max_restarts,
                self.policy.window,
            )
            return False
        e.restart_at = time.monotonic() + delay
        logger.error("%s %s; restarting it in %.1f s", e.name, what, delay)
        return True

    def _hand_over(self, e: EngineProcess) -> None:
        """Tell each API process that engine `e` is back: its model, rank and generation, and
        the new process's alive pipe (each gets its own descriptor)."""
        assert e.alive is not None
        # Counted before any API process hears of it: whoever sees the engine serve again
        # (/health 200) sees the restart counted too.
        if self.on_restart is not None:
            self.on_restart(e)
        for api, control in zip(self.apis, self.controls, strict=True):
            if api.exitcode is not None or api.pid is None:
                continue
            with contextlib.suppress(OSError):  # that API process is gone
                control.send(("engine", e.model, e.rank, e.generation))
                send_handle(control, e.alive.fileno(), api.pid)
        e.alive.close()
        e.alive = None
        logger.info("%s restarted (pid %s), serving again", e.name, e.process.pid)


def stop(processes: Sequence[BaseProcess], seconds: float) -> None:
    """SIGTERM each (uvicorn drains its connections), then SIGKILL what is left."""
    for p in processes:
        if p.exitcode is None and p.pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p.pid, signal.SIGTERM)
    deadline = time.monotonic() + seconds
    for p in processes:
        if p.pid is None:
            continue
        p.join(max(0.0, deadline - time.monotonic()))
        if p.exitcode is None:
            p.kill()
            p.join()


def report_start_failure(result: tuple[int, str]) -> int:
    """Say why an engine failed to load at start; the exit status."""
    print(f"vecpool serve: {result[1]}", file=sys.stderr)
    return result[0]
