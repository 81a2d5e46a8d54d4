"""Where a CPU step's time goes: torch.profiler over vecpool's `Engine.embed` and
sentence-transformers' `encode` on bench_cpu.py's workloads (the packaged MiniLM, float32).

    python benchmarks/lab/profile_cpu.py [--workload queries|passages] [--rows 25]
        [--systems vecpool vecpool-int8 st-32]

Under an AVX2 cap, set bench_cpu.py's caps (`ONEDNN_MAX_CPU_ISA=AVX2` ...) in its environment.

Prints, for each system, the wall time of one profiled call and the operators that took the
most self CPU time.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks.bench_gpu import make_inputs, st_runner, vecpool_runner, workload_lengths


def main(argv: list[str] | None = None) -> None:
    import tokenizers

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workload", choices=("queries", "passages"), default="queries")
    parser.add_argument("--num", type=int, help="inputs (default: 1024 queries, 256 passages)")
    parser.add_argument("--rows", type=int, default=25)
    parser.add_argument("--systems", nargs="+", default=["vecpool", "st-32"])
    parser.add_argument("--threads", type=int, help="torch.set_num_threads")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from vecpool.api import default_model_path

    folder = default_model_path()
    tokenizer = tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json"))
    tokenizer.no_truncation()
    tokenizer.no_padding()
    num = args.num or (1024 if args.workload == "queries" else 256)
    texts, ids = make_inputs(tokenizer, workload_lengths(args.workload, num))
    for system in args.systems:
        if system in ("vecpool", "vecpool-int8"):
            quantization = "int8" if system == "vecpool-int8" else None
            run, _ = vecpool_runner(
                folder,
                "cpu",
                "float32",
                text=True,
                compile=None,
                budget=None,
                quantization=quantization,
            )
        else:
            run, _ = st_runner(folder, "cpu", torch.float32, int(system.removeprefix("st-")))
        run(texts, ids)  # warm-up
        start = time.perf_counter()
        run(texts, ids)
        plain = time.perf_counter() - start
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            start = time.perf_counter()
            run(texts, ids)
            profiled = time.perf_counter() - start
        print(f"== {system} {args.workload}: {plain:.2f} s plain, {profiled:.2f} s profiled")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows))


if __name__ == "__main__":
    main(sys.argv[1:])
