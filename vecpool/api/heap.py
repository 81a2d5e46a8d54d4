"""An engine's long-lived objects kept out of the interpreter's full garbage collections.

CPython's collector walks every object it tracks in a full pass, and starts one whenever the
objects promoted to its oldest generation since the last pass reach a quarter of those that
survived it. A compiled engine holds half a million such objects (modules, compiled graphs and
their guards, Triton's kernels), and each call promotes its requests and results: every few
calls a full pass walks the engine's objects in the middle of a step (on 2 cores, 230-249 ms
in one call of twelve of 2,048 queries, ~0.37 s each; benchmarks/results/
gc_stalls_tiny-qwen3_compiled_2core.json). `gc.freeze` moves every tracked object into a
permanent generation that no pass walks. An engine freezes once it is built (model, graphs
recorded at start-up) and again after a call, or a serving loop's step, in which torch.compile
compiled (what it made lives as long as the engine); the server's processes freeze their
start-up the same way.

What this costs: garbage in reference cycles among objects alive at a freeze (the caller's
too) is reclaimed only after `gc.unfreeze()`. Objects freed by their reference counts are not
affected: a dropped engine frees its tensors, its tokenizer processes end (tested). The frozen
objects are unfrozen at exit, so that the interpreter's last collection still finalizes them.
"""

from __future__ import annotations

import atexit
import gc
import sys

# False: nothing is frozen (the baseline `benchmarks/lab/gc_stalls.py` measures against).
FREEZE = True

# torch.compile's count of compiled frames at the last freeze (process-wide, as the collector
# is); None before the first.
_frames_at_freeze: int | None = None


def _compiled_frames() -> int:
    """How many frames torch.compile has compiled in this process: 0 while nothing has loaded
    its machinery (importing it for the count would cost a process about a second)."""
    utils = sys.modules.get("torch._dynamo.utils")
    counters = getattr(utils, "counters", None)
    return 0 if counters is None else int(counters["frames"]["total"])


def freeze() -> None:
    """Collect what is garbage now, then keep every object left out of later full passes."""
    global _frames_at_freeze
    if not FREEZE:
        return
    if _frames_at_freeze is None:
        atexit.register(gc.unfreeze)
    gc.collect()
    gc.freeze()
    _frames_at_freeze = _compiled_frames()


def freeze_if_compiled() -> None:
    """`freeze` if torch.compile compiled anything since the last one (called after each of an
    engine's calls, and after each step of a serving loop: only the first step of a kind
    compiles)."""
    if _frames_at_freeze is not None and _compiled_frames() != _frames_at_freeze:
        freeze()
