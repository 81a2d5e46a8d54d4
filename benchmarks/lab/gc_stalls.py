"""The interpreter's full garbage collections inside a row of `Engine.embed` calls, with the
engine's objects walked by them (`unfrozen`) and kept out of them (`frozen`, what an engine
does once built: `vecpool.api.heap`), in one process on the same engine and inputs.

    PYTHONPATH=. python benchmarks/lab/gc_stalls.py --models qwen3-0.6b --tokenizer DIR

CPython's collector walks every tracked object in a full pass, which starts once the objects
promoted to its oldest generation since the last pass reach a quarter of those that survived
it. A compiled engine holds hundreds of thousands of objects and every call promotes its
requests and results, so every few calls a full pass walks them all in the middle of a step.
A round is `--calls` calls back to back, nothing collected between them by this script; the
two states alternate round by round (`unfrozen`: `gc.unfreeze()`; `frozen`: `gc.collect()`
then `gc.freeze()`), the engine built with `heap.FREEZE` off so that only the script freezes.
Per state: tokens/s over each round's calls (a stall every few calls shows in a round's total,
not in a median call), the median of the rounds, every call's seconds, and the full passes
inside each round with their milliseconds; the objects the collector tracks once the engine
is warm. Bench shapes with random weights, token ids, the engine's defaults (`--compile`
compiles on the CPU too, which holds as many objects as a compiled CUDA engine).
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import tokenizers
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import vecpool
from benchmarks import record
from benchmarks.workloads import SHAPES, WORKLOADS, make_inputs, workload_lengths, write_folder
from vecpool.api import heap

STATES = ("unfrozen", "frozen")


class FullPasses:
    """The collector's passes over its oldest generation, timed, while installed."""

    def __init__(self) -> None:
        self.millis: list[float] = []
        self._started = 0.0

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        if info["generation"] != 2:
            return
        if phase == "start":
            self._started = time.perf_counter()
        else:
            self.millis.append((time.perf_counter() - self._started) * 1e3)


def _set(state: str) -> None:
    if state == "frozen":
        gc.collect()
        gc.freeze()
    else:
        gc.unfreeze()


def _round(engine: vecpool.Engine, ids: list[list[int]], calls: int, device: str) -> dict[str, Any]:
    passes = FullPasses()
    gc.callbacks.append(passes)
    seconds = []
    try:
        for _ in range(calls):
            if device == "cuda":
                torch.cuda.synchronize()
            started = time.perf_counter()
            engine.embed(ids, show_progress=False)
            if device == "cuda":
                torch.cuda.synchronize()
            seconds.append(time.perf_counter() - started)
    finally:
        gc.callbacks.remove(passes)
    tokens = sum(map(len, ids)) * calls
    return {
        "tokens_per_s": tokens / sum(seconds),
        "call_seconds": seconds,
        "full_passes_ms": passes.millis,
    }


def main(argv: list[str]) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=["qwen3-0.6b"], choices=sorted(SHAPES))
    parser.add_argument("--workloads", nargs="+", default=["queries"], choices=WORKLOADS)
    parser.add_argument("--tokenizer", type=Path, required=True)
    parser.add_argument("--n", type=int, default=4096, help="inputs per call")
    parser.add_argument("--calls", type=int, default=12, help="calls per round")
    parser.add_argument("--rounds", type=int, default=record.MIN_ROUNDS, help="rounds per state")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument(
        "--compile",
        action="store_true",
        help="compile the engines' layers (default: the engine's choice, on CUDA)",
    )
    parser.add_argument("--output", type=Path)
    record.add_args(parser)
    args = parser.parse_args(argv)
    report: dict[str, Any] = record.header(
        "lab/gc_stalls.py", argv, device=args.device, commit=args.commit
    )
    tokenizer = tokenizers.Tokenizer.from_file(str(args.tokenizer / "tokenizer.json"))
    switch = heap.FREEZE
    heap.FREEZE = False
    try:
        report["rows"] = [row for name in args.models for row in _model_rows(name, args, tokenizer)]
    finally:
        heap.FREEZE = switch
    record.write(args.output, report)
    return report


def _model_rows(name: str, args: argparse.Namespace, tokenizer: Any) -> list[dict[str, Any]]:
    rows = []
    folder = write_folder(SHAPES[name], Path(tempfile.mkdtemp()), args.tokenizer, args.device)
    engine = vecpool.Engine(folder, device=args.device, compile=True if args.compile else None)
    for workload in args.workloads:
        _, ids = make_inputs(tokenizer, workload_lengths(workload, args.n))
        gc.unfreeze()
        engine.embed(ids[:512], show_progress=False)
        engine.embed(ids, show_progress=False)
        tracked = len(gc.get_objects())
        runs: dict[str, list[dict[str, Any]]] = {state: [] for state in STATES}
        for r in range(args.rounds):
            for state in STATES if r % 2 == 0 else STATES[::-1]:
                _set(state)
                runs[state].append(_round(engine, ids, args.calls, args.device))
        gc.unfreeze()
        medians = {s: statistics.median(x["tokens_per_s"] for x in runs[s]) for s in STATES}
        row = {
            "model": name,
            "workload": workload,
            "num_inputs": len(ids),
            "num_tokens": sum(map(len, ids)),
            "tracked_objects_when_warm": tracked,
            "tokens_per_s": medians,
            "frozen_over_unfrozen": medians["frozen"] / medians["unfrozen"],
            "full_passes_per_round": {
                s: [len(x["full_passes_ms"]) for x in runs[s]] for s in STATES
            },
            "rounds": runs,
        }
        rows.append(row)
        print(
            name,
            workload,
            f"tracked {tracked}",
            {s: f"{medians[s]:,.0f} tok/s" for s in STATES},
            f"{row['frozen_over_unfrozen']:.3f}x",
            {s: [[round(m) for m in x["full_passes_ms"]] for x in runs[s]] for s in STATES},
            flush=True,
        )
    del engine
    if args.device == "cuda":
        torch.cuda.empty_cache()
    return rows


if __name__ == "__main__":
    main(sys.argv[1:])
