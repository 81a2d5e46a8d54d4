"""Pooling a step after the next step's forward is queued (`EngineCore.run_ahead`) against
pooling each step at once, in one process on the same engine and inputs, rounds interleaved.

    PYTHONPATH=. python benchmarks/ab_run_ahead.py --models bert-base --tokenizer DIR

For each `bench_gpu.py` shape and workload (from token ids, the engine's defaults): a warm-up,
then `--rounds` pairs of `Engine.embed` calls, the order inside each pair alternating; tokens
per second, the median of the rounds with every round kept, and the ratio of the medians. Both
orders run the same steps through the same kernels: their outputs must be identical (checked).
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

import numpy as np
import tokenizers
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import vecpool
from benchmarks import record
from benchmarks.workloads import SHAPES, WORKLOADS, make_inputs, workload_lengths, write_folder

ORDERS = {"run-ahead": True, "in order": False}


def _timed(engine: vecpool.Engine, ids: list[list[int]], device: str) -> tuple[float, np.ndarray]:
    if device == "cuda":
        torch.cuda.synchronize()
    started = time.perf_counter()
    out = engine.embed(ids, show_progress=False)
    return time.perf_counter() - started, out


def main(argv: list[str]) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=["bert-base"], choices=sorted(SHAPES))
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=WORKLOADS)
    parser.add_argument("--tokenizer", type=Path, required=True)
    parser.add_argument("--n", type=int, default=4096, help="inputs per call")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--output", type=Path)
    record.add_args(parser)
    args = parser.parse_args(argv)
    report = record.header("ab_run_ahead.py", argv, device=args.device, commit=args.commit)
    tokenizer = tokenizers.Tokenizer.from_file(str(args.tokenizer / "tokenizer.json"))
    rows = report["rows"] = []
    for name in args.models:
        folder = write_folder(SHAPES[name], Path(tempfile.mkdtemp()), args.tokenizer, args.device)
        engine = vecpool.Engine(folder, device=args.device)
        limit = engine.info().max_model_len
        for workload in args.workloads:
            lengths = workload_lengths(workload, args.n).clip(max=limit)
            _, ids = make_inputs(tokenizer, lengths)
            engine.embed(ids[:512], show_progress=False)
            gc.collect()
            gc.freeze()
            seconds: dict[str, list[float]] = {order: [] for order in ORDERS}
            outputs: dict[str, np.ndarray] = {}
            for i in range(args.rounds):
                for order in sorted(ORDERS, reverse=i % 2 == 1):
                    engine.core.run_ahead = ORDERS[order]
                    took, outputs[order] = _timed(engine, ids, args.device)
                    seconds[order].append(took)
            gc.unfreeze()
            engine.core.run_ahead = True
            tokens = int(lengths.sum())
            per_order = {
                order: {
                    "tokens_per_s": tokens / statistics.median(values),
                    "seconds": values,
                }
                for order, values in seconds.items()
            }
            row = {
                "model": name,
                "workload": workload,
                "num_inputs": len(ids),
                "num_tokens": tokens,
                **per_order,
                "ratio": per_order["run-ahead"]["tokens_per_s"]
                / per_order["in order"]["tokens_per_s"],
                "identical": bool(np.array_equal(outputs["run-ahead"], outputs["in order"])),
            }
            rows.append(row)
            print(
                f"{name:11s} {workload:8s} run-ahead {row['run-ahead']['tokens_per_s']:,.0f} "
                f"in order {row['in order']['tokens_per_s']:,.0f} tok/s: "
                f"{row['ratio']:.3f}x, identical {row['identical']}",
                flush=True,
            )
            record.write(args.output, report)
        del engine
    return report


if __name__ == "__main__":
    main(sys.argv[1:])
