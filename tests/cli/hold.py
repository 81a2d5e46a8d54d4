"""`python -m tests.cli.hold ARGS`: `vecpool ARGS` that stops still once part N of
`vecpool embed`'s work folder is committed (N from the variable below), until a signal ends it.

A test that interrupts a run "after part N" then interrupts it there by construction: no later
part can be written however fast the machine is, and the signal lands while the run waits.
vecpool itself reads no such variable; spawned engine processes (data parallel) run this
module as their main too, where the wrapper is never reached.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

ENV = "VECPOOL_TEST_HOLD_AFTER_PART"
# The run goes on by itself after this long: a test that died first cannot leave it behind.
HOLD_SECONDS = 120


def install(after_part: int) -> None:
    """Wrap `WorkFolder.add_part` in this process: it waits once part `after_part` is in."""
    from vecpool.cli.output import WorkFolder

    add_part = WorkFolder.add_part

    def held(self: WorkFolder, *args: Any) -> None:
        add_part(self, *args)
        if len(self.parts) == after_part + 1:
            deadline = time.monotonic() + HOLD_SECONDS
            while time.monotonic() < deadline:
                time.sleep(0.01)

    WorkFolder.add_part = held  # type: ignore[method-assign]


if os.environ.get(ENV):
    install(int(os.environ[ENV]))

if __name__ == "__main__":
    from vecpool.cli.main import main

    sys.exit(main())
