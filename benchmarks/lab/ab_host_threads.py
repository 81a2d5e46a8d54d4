"""A large call's two host threads, in one process on the same engine and inputs, rounds
interleaved: how far the input worker runs ahead of the steps (`--vary ahead`, the engine's
`PIPELINE_AHEAD`), whether it waits for the first step's forward before preparing the second
chunk (`--vary first-alone`, 1 or 0: `PIPELINE_FIRST_ALONE`), whether plain texts of BERT's
WordPiece are tokenized by `vecpool.inputs.wordpiece`'s array path or by the `tokenizers` library
(`--vary wordpiece`, 1 or 0: `tokenizer.WORDPIECE_MIN_CHARS` as set, or past any batch), how
many child processes tokenize large batches of texts (`--vary tokenizer-processes`, 0: none, the
worker tokenizes; each `tokenizer_pool.TokenizerPool` started before the clock) or the
interpreter's thread switch interval (`--vary switch-interval`, `sys.setswitchinterval`), or
whether lists of token ids are packed straight into arrays or converted by numpy (`--vary
pack-ids`, 1 or 0: `arrays.PACK_ID_LISTS`), or how many inputs the first chunk of a large call
holds (`--vary first-chunk`: `PIPELINE_FIRST_CHUNK`; the device gets its first step once that
chunk is prepared, and that step is all it has while the host launches the second).

    PYTHONPATH=. python benchmarks/lab/ab_host_threads.py --models bert-base --tokenizer DIR \
        --vary ahead --values 1 2

A large call runs on two threads of one interpreter: the caller's, which runs the engine's
steps, and the worker that prepares (tokenizes) the next chunks. A chunk that is not ready when
a step's forward is queued cannot join the next step, and the device waits for it; and each
torch call of the engine thread lets go of the interpreter lock, which it gets back only when
the worker lets go too or the switch interval (5 ms by default) runs out. This measures
`Engine.embed` of `bench_gpu.py`'s workloads from text and from ids under each value: tokens
per second and MFU, the median of `--rounds` rounds (the values' order rotating from round to
round), every round kept, each value's ratio to the first one's, and the largest difference of
the outputs from the first one's (a chunk joins the steps when it is ready, so the steps'
makeup, and with it the last bits of a row, may differ from run to run).

`--simulate-device RATE` needs no GPU: `bench_host.py`'s engine (the model's forward stubbed
out, on the CPU) with a simulated device that runs RATE tokens per second, one step after the
other: a forward returns at once and its step's pooling sleeps (the lock let go) until the
simulated device would have finished it, as pooling waits for a GPU. It shows whether the
host keeps such a device busy. `--simulate-launch MS` adds a forward's launch: the host busy
for MS milliseconds a step, the interpreter lock held, as while a compiled model's kernels are
queued (the device starts on the step as the launch begins). `--models` is then ignored and MFU
not given.
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

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import vecpool
import vecpool.api.running
import vecpool.inputs.arrays
import vecpool.inputs.tokenizer
from benchmarks import record
from benchmarks.bench_gpu import flop_model, matmul_ceiling
from benchmarks.lab.ab_run_ahead import _timed
from benchmarks.lab.bench_host import stub_engine
from benchmarks.workloads import SHAPES, WORKLOADS, make_inputs, workload_lengths, write_folder
from vecpool.inputs import tokenizer_pool

_WORDPIECE_MIN_CHARS = vecpool.inputs.tokenizer.WORDPIECE_MIN_CHARS


def _set(vary: str, value: float, engine: vecpool.Engine, pools: dict[float, Any]) -> None:
    if vary == "tokenizer-processes":
        engine.inputs.tokenizer_pool = pools.get(value)
    elif vary == "ahead":
        vecpool.api.running.PIPELINE_AHEAD = int(value)
    elif vary == "first-alone":
        vecpool.api.running.PIPELINE_FIRST_ALONE = bool(value)
    elif vary == "wordpiece":
        vecpool.inputs.tokenizer.WORDPIECE_MIN_CHARS = (
            _WORDPIECE_MIN_CHARS if value else sys.maxsize
        )
    elif vary == "pack-ids":
        vecpool.inputs.arrays.PACK_ID_LISTS = bool(value)
    elif vary == "first-chunk":
        vecpool.api.running.PIPELINE_FIRST_CHUNK = int(value)
    else:
        sys.setswitchinterval(value)


def _simulated_device(tokenizer_dir: Path, rate: float, launch: float = 0.0) -> vecpool.Engine:
    """`bench_host.py`'s stub engine, its steps timed as a device of `rate` tokens/s runs them,
    each forward's launch keeping the host busy `launch` seconds (the lock held)."""
    engine = stub_engine(tokenizer_dir)
    free_at = [0.0]  # when the simulated device is done with every step queued so far
    done_at: dict[int, float] = {}  # by id() of a step's output
    forward, pool = engine.model_runner.forward, engine.core.pooling_runner.pool

    def timed_forward(batch: Any) -> torch.Tensor:
        started = time.perf_counter()
        while time.perf_counter() - started < launch:  # queuing kernels: the lock is not let go
            pass
        hidden = forward(batch)
        free_at[0] = max(free_at[0], started) + batch.num_tokens / rate
        done_at[id(hidden)] = free_at[0]
        return hidden

    def waiting_pool(hidden: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        wait = done_at.pop(id(hidden), 0.0) - time.perf_counter()
        if wait > 0:
            time.sleep(wait)
        return pool(hidden, *args, **kwargs)

    engine.model_runner.forward = timed_forward  # type: ignore[method-assign]
    engine.core.pooling_runner.pool = waiting_pool  # type: ignore[method-assign]
    return engine


def main(argv: list[str]) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=["bert-base"], choices=sorted(SHAPES))
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=WORKLOADS)
    parser.add_argument("--forms", nargs="+", default=["text", "ids"], choices=["text", "ids"])
    parser.add_argument(
        "--vary",
        choices=[
            "ahead",
            "first-alone",
            "wordpiece",
            "switch-interval",
            "tokenizer-processes",
            "pack-ids",
            "first-chunk",
        ],
        required=True,
    )
    parser.add_argument(
        "--values", nargs="+", type=float, required=True, help="the first is the baseline"
    )
    parser.add_argument("--tokenizer", type=Path, required=True)
    parser.add_argument("--n", type=int, default=4096, help="inputs per call")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument(
        "--simulate-device",
        type=float,
        metavar="RATE",
        help="the stubbed model on the CPU, with a simulated device of RATE tokens/s",
    )
    parser.add_argument(
        "--simulate-launch",
        type=float,
        default=0.0,
        metavar="MS",
        help="with --simulate-device: the host's milliseconds a step to queue its forward",
    )
    parser.add_argument("--output", type=Path)
    record.add_args(parser)
    args = parser.parse_args(argv)
    report = record.header("lab/ab_host_threads.py", argv, device=args.device, commit=args.commit)
    tokenizer = tokenizers.Tokenizer.from_file(str(args.tokenizer / "tokenizer.json"))
    rows = report["rows"] = []
    default = {
        "ahead": vecpool.api.running.PIPELINE_AHEAD,
        "first-alone": int(vecpool.api.running.PIPELINE_FIRST_ALONE),
        "wordpiece": 1,
        "pack-ids": 1,
        "first-chunk": vecpool.api.running.PIPELINE_FIRST_CHUNK,
        "tokenizer-processes": tokenizer_pool.default_size(),
    }.get(args.vary, sys.getswitchinterval())
    simulated = args.simulate_device is not None
    if simulated:
        args.device = "cpu"
        report["simulated_device_tokens_per_s"] = args.simulate_device
        report["simulated_launch_ms"] = args.simulate_launch
    ceiling = None if simulated else matmul_ceiling(torch.device(args.device))
    report["ceiling_flops"] = ceiling
    for name in ["stub"] if simulated else args.models:
        if simulated:
            engine = _simulated_device(
                args.tokenizer, args.simulate_device, args.simulate_launch / 1e3
            )
            flops = None
        else:
            folder = write_folder(
                SHAPES[name], Path(tempfile.mkdtemp()), args.tokenizer, args.device
            )
            flops = flop_model(folder)
            engine = vecpool.Engine(folder, device=args.device)
        limit = engine.info().max_model_len
        pools: dict[float, Any] = {}  # by size (0: none), each started before the clock
        if args.vary == "tokenizer-processes":
            path = args.tokenizer / "tokenizer.json"
            pools = {v: tokenizer_pool.TokenizerPool(path, int(v)) for v in args.values if v}
            for pool in pools.values():
                pool.start()
                if not pool.wait_ready(60):
                    raise SystemExit("the tokenizer processes did not start")
            pools.setdefault(default, engine.inputs.tokenizer_pool)  # restored after the rounds
        for workload in args.workloads:
            lengths = workload_lengths(workload, args.n).clip(max=limit)
            texts, ids = make_inputs(tokenizer, lengths)
            tokens = int(lengths.sum())
            for form in args.forms:
                inputs: list[Any] = texts if form == "text" else ids
                engine.embed(inputs, show_progress=False)  # warm-up: graphs, compiled kernels
                gc.collect()
                gc.freeze()
                seconds: dict[float, list[float]] = {v: [] for v in args.values}
                outputs: dict[float, np.ndarray] = {}
                try:
                    for r in range(args.rounds):
                        k = r % len(args.values)
                        for value in args.values[k:] + args.values[:k]:
                            _set(args.vary, value, engine, pools)
                            took, outputs[value] = _timed(engine, inputs, args.device)
                            seconds[value].append(took)
                finally:
                    _set(args.vary, default, engine, pools)
                    gc.unfreeze()
                base = args.values[0]
                per_value = {
                    f"{value:g}": {
                        "tokens_per_s": tokens / statistics.median(values),
                        "mfu": (
                            flops.flops(lengths) / statistics.median(values) / ceiling
                            if flops is not None and ceiling is not None
                            else None
                        ),
                        "seconds": values,
                        "ratio": statistics.median(seconds[base]) / statistics.median(values),
                        "max_abs_diff": float(np.abs(outputs[value] - outputs[base]).max()),
                    }
                    for value, values in seconds.items()
                }
                rows.append(
                    {
                        "model": name,
                        "workload": workload,
                        "form": form,
                        "num_inputs": len(inputs),
                        "num_tokens": tokens,
                        "vary": args.vary,
                        "values": per_value,
                    }
                )
                print(
                    f"{name:11s} {workload:8s} {form:4s} "
                    + "  ".join(
                        f"{k}: {v['tokens_per_s']:,.0f} "
                        + ("" if v["mfu"] is None else f"{v['mfu']:.1%} ")
                        + f"({v['ratio']:.2f}x, "
                        f"diff {v['max_abs_diff']:.1g})"
                        for k, v in per_value.items()
                    ),
                    flush=True,
                )
                record.write(args.output, report)
        del engine
    return report


if __name__ == "__main__":
    main(sys.argv[1:])
