"""A gate before the engine process's steps that a test closes and opens: the engine holds
still with its work queued, by construction, for as long as the test needs (a full queue, a
client that leaves while its inputs wait, a SIGTERM with requests in flight), instead of a race
against its speed.

For a `vecpool serve` subprocess (`start_server(..., gate=EngineGate(folder))`): the server runs
as `python -m tests.server.gate serve ...`, which is `vecpool serve` with `EngineLoop._step`
wrapped. The engine processes get the wrapper: multiprocessing's spawn runs the parent's main
module (this one) in each child before its target, and the variable below, inherited, tells it
where the gate is. vecpool itself reads no such variable.

The gate is a folder: while its file `closed` exists, an engine with work to step touches
`entered` and waits, taking the calls and cancels that arrive meanwhile as its loop does (so a
test sees them in `vecpool_queue_size` and the replies go out), but stepping none.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

ENV = "VECPOOL_TEST_GATE"  # the gate's folder, read by this module only
# A held step goes on by itself after this long: a test that died holding it cannot wedge
# the server for the rest of the session.
HOLD_SECONDS = 120


class EngineGate:
    """The test's side of a gate at `folder`."""

    def __init__(self, folder: Path):
        folder.mkdir(parents=True, exist_ok=True)
        self.folder = folder
        self._closed = folder / "closed"
        self._entered = folder / "entered"

    @property
    def env(self) -> dict[str, str]:
        """What a server process's environment needs for the gate."""
        return {ENV: str(self.folder)}

    def close(self) -> None:
        """The next step (and every one after, until `open`) waits."""
        self._entered.unlink(missing_ok=True)
        self._closed.touch()

    def open(self) -> None:
        self._closed.unlink(missing_ok=True)

    @contextmanager
    def held(self) -> Iterator[None]:
        """Closed inside the block, open after it (whatever the block raised)."""
        self.close()
        try:
            yield
        finally:
            self.open()

    def wait_entered(self, timeout: float = 60) -> None:
        """Until a step waits at the gate (the engine has work). `timeout` only bounds a
        failure: the step comes once the test has sent work."""
        deadline = time.monotonic() + timeout
        while not self._entered.exists():
            assert time.monotonic() < deadline, "no engine step reached the gate"
            time.sleep(0.005)


def install(folder: Path) -> None:
    """Wrap `EngineLoop._step` in this process: it waits while `folder/closed` exists."""
    from vecpool.server.engine_process import EngineLoop

    step = EngineLoop._step
    closed, entered = folder / "closed", folder / "entered"

    def gated(self: EngineLoop) -> Any:
        if closed.exists():
            entered.touch()
            deadline = time.monotonic() + HOLD_SECONDS
            while closed.exists() and time.monotonic() < deadline:
                self._receive()
                self._flush()  # refusals answered, the queue's size recorded
                time.sleep(0.001)
        return step(self)

    EngineLoop._step = gated  # type: ignore[method-assign]


# In the server's children only, which run this module as their main module (`__mp_main__`):
# the supervisor itself never steps, and importing the engine loop there would import
# prometheus-client before the supervisor points it at the metrics directory.
if os.environ.get(ENV) and __name__ == "__mp_main__":
    install(Path(os.environ[ENV]))

if __name__ == "__main__":
    from vecpool.cli.main import main

    sys.exit(main())
