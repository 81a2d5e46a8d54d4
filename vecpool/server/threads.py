"""How the processes of a server share the machine's cores.

On the CPU the engine's matrix products and the API processes' HTTP, tokenizing and encoding
compete for the same cores. Left alone, every process starts one OpenMP thread per core and
every thread spins while it waits for work, so that at 64 clients half of all CPU time went to
the kernel and requests/s fell to half of 8 clients'. The budget: each API process gets one
compute thread, and threads that wait sleep instead of spinning (`OMP_WAIT_POLICY=PASSIVE`).
The engine processes share the cores the API processes leave (at least one each), except on a
small machine, where they share every core: an API process's CPU per single-query request is
a small part of the engine's (0.4-0.7 ms against 7-12 ms, all-MiniLM-L6-v2 on 2 cores), so a
core kept for it would idle most of the time while the engine, on the other core alone, sets
the pace; beside sleeping engine threads it takes the moments it needs.

OpenMP, MKL and the tokenizers' thread pool read their sizes from the environment when they
start, which in a child happens while it imports its modules, before any of our code runs: so
the supervisor sets the variables in its own environment around each child's start
(`child_threads`), and an engine process applies the same count to torch once more
(`engine_process.apply_threads`; the API processes load no torch).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass

# Compute threads of one API process: it runs no model; more threads would only spin.
API_PROCESS_THREADS = 1
# The API processes are kept cores of their own only where the engines keep at least this
# share of the machine; below it (1 API process on 2 or 3 cores) the engines take every core.
ENGINE_SHARE_OF_CORES = 0.75


@dataclass(frozen=True)
class ThreadBudget:
    """Compute threads each process of a server may start."""

    engine: int | None  # each engine process; None: as torch decides (a CUDA engine)
    api: int = API_PROCESS_THREADS  # each API-server process


def thread_budget(*, cpu: bool, cores: int, api_processes: int, engines: int) -> ThreadBudget:
    """The budget of a server whose `engines` engine processes run on the CPU (`cpu`) or each
    on a GPU, beside `api_processes` API processes, on a machine of `cores` compute threads:
    on the CPU, engine threads times engines plus API processes stay within `cores` where that
    leaves the engines `ENGINE_SHARE_OF_CORES` of them; on a smaller machine the engines share
    every core (every engine keeps at least one thread)."""
    if not cpu:
        return ThreadBudget(engine=None)
    left = cores - api_processes * API_PROCESS_THREADS
    if left < cores * ENGINE_SHARE_OF_CORES:
        left = cores
    return ThreadBudget(engine=max(1, left // max(1, engines)))


def thread_environment(threads: int) -> dict[str, str]:
    """The variables that size a process's compute pools to `threads` and keep their idle
    threads asleep."""
    n = str(threads)
    return {
        "OMP_NUM_THREADS": n,
        "MKL_NUM_THREADS": n,
        "OMP_WAIT_POLICY": "PASSIVE",
        "RAYON_NUM_THREADS": n,  # the tokenizers' pool (batch encoding)
    }


@contextlib.contextmanager
def child_threads(threads: int | None) -> Iterator[None]:
    """Inside: children started from this process get `threads` compute threads (None:
    the environment as it is). The environment is restored on exit."""
    if threads is None:
        yield
        return
    changed = thread_environment(threads)
    previous = {name: os.environ.get(name) for name in changed}
    os.environ.update(changed)
    try:
        yield
    finally:
        for name, value in previous.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
