"""`vecpool serve` whose image fetches may take `READ_SECONDS` to arrive whole (the media
policy's read timeout; 10 s by default): a test that waits less than that for a fetch to be cut
off knows that whatever cut it, the read timeout did not.

Run as `python -m tests.server.media_reads serve ...` (`ServerSpec(module=...)`). The engine
process builds the policy (`EngineArgs.media_policy`) and hands it to the API processes; the
wrapper is installed in the server's process and in its children, which run this module as
their main module (`__mp_main__`, as `tests/server/gate.py` explains)."""

from __future__ import annotations

import dataclasses
import sys
from typing import Any

READ_SECONDS = 3600.0


def install() -> None:
    """`EngineArgs.media_policy` gives its policy with `read_timeout` READ_SECONDS."""
    from vecpool.api.args import EngineArgs

    policy = EngineArgs.media_policy

    def long_reads(self: EngineArgs) -> Any:
        return dataclasses.replace(policy(self), read_timeout=READ_SECONDS)

    EngineArgs.media_policy = long_reads  # type: ignore[method-assign]


if __name__ in ("__main__", "__mp_main__"):
    install()

if __name__ == "__main__":
    from vecpool.cli.main import main

    sys.exit(main())
