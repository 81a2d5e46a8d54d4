"""What each process of a `vecpool serve` subprocess may compute with, written down by the
process itself: `python -m tests.server.thread_probe serve ...` is `vecpool serve`, and each of
its children (which run this module as their main module, `__mp_main__`, before their target)
records into the folder named by the variable below: at start, before any of vecpool's code
runs in it, the compute threads torch would use and the thread-pool variables it inherited;
in an engine process, after each step, torch's thread count then and the threads the process
has. vecpool itself reads no such variable.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

ENV = "VECPOOL_TEST_THREAD_PROBE"  # the folder, read by this module only
VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OMP_WAIT_POLICY", "RAYON_NUM_THREADS")


def threads_now() -> int:
    """The threads this process has (its /proc task entries)."""
    return len(os.listdir("/proc/self/task"))


def record(folder: Path, kind: str, **values: Any) -> None:
    with (folder / f"{os.getpid()}.jsonl").open("a") as out:
        out.write(json.dumps({"kind": kind, **values}) + "\n")


def install(folder: Path) -> None:
    import torch

    record(
        folder,
        "start",
        torch_threads=torch.get_num_threads(),
        threads=threads_now(),
        env={name: os.environ.get(name) for name in VARIABLES},
    )
    from vecpool.server.engine_process import EngineLoop

    step = EngineLoop._step

    def probed(self: EngineLoop) -> Any:
        before = threads_now()
        out = step(self)
        record(
            folder,
            "step",
            torch_threads=torch.get_num_threads(),
            before=before,
            after=threads_now(),
        )
        return out

    EngineLoop._step = probed  # type: ignore[method-assign]


if os.environ.get(ENV) and __name__ == "__mp_main__":
    install(Path(os.environ[ENV]))

if __name__ == "__main__":
    from vecpool.cli.main import main

    sys.exit(main())
