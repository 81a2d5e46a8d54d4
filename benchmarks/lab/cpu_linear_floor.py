"""The matrix-product floor of an fp32 CPU step: how fast this CPU's linears run, and what
that bounds a MiniLM workload's time to.

    python benchmarks/lab/cpu_linear_floor.py [--output benchmarks/results/NAME.json]

Times one core (process CPU seconds, steady on a shared machine) on all-MiniLM-L6-v2's four
linear shapes at a 4,096-row step: oneDNN with the weight prepacked (vecpool's CPU linears)
and `F.linear` (BLAS; what sentence-transformers runs). From the packed rate it gives each
bench_cpu.py workload's seconds on two cores if its step were nothing but these products
(perfect scaling, no attention, norms or copies): a bound on what any exact fp32 engine using
these kernels can reach, to set beside sentence-transformers' measured seconds.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks.record import git_commit

HIDDEN, INTERMEDIATE, LAYERS = 384, 1536, 6
# (in, out) of one layer's products: fused q/k/v, attention output, intermediate, output.
SHAPES = [(HIDDEN, 3 * HIDDEN), (HIDDEN, HIDDEN), (HIDDEN, INTERMEDIATE), (INTERMEDIATE, HIDDEN)]
WORKLOAD_TOKENS = {"queries": 37724, "passages": 45481}  # bench_cpu.py's defaults


def cpu_seconds(fn, rounds: int) -> list[float]:  # type: ignore[no-untyped-def]
    fn()
    out = []
    for _ in range(rounds):
        start = time.process_time()
        fn()
        out.append(time.process_time() - start)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=4096)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--output", type=Path)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    flop_per_token = sum(2 * k * n for k, n in SHAPES) * LAYERS
    report: dict = {
        "command": "python benchmarks/lab/cpu_linear_floor.py " + " ".join(argv or []),
        "commit": git_commit(),
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "device": f"CPU ({platform.processor() or platform.machine()}), one core",
        "rows": args.rows,
        "flop_per_token": flop_per_token,
        "shapes": {},
    }
    totals = {"packed": 0.0, "blas": 0.0}
    for k, n in SHAPES:
        x = torch.randn(args.rows, k, generator=gen)
        w, b = torch.randn(n, k, generator=gen), torch.randn(n, generator=gen)
        packed = torch.ops.mkldnn._reorder_linear_weight(w, None)
        runs = {
            "packed": cpu_seconds(
                lambda: torch.ops.mkldnn._linear_pointwise(x, packed, b, "none", [], ""),  # noqa: B023
                args.rounds,
            ),
            "blas": cpu_seconds(lambda: F.linear(x, w, b), args.rounds),  # noqa: B023
        }
        entry = {}
        for name, seconds in runs.items():
            median = statistics.median(seconds)
            totals[name] += median
            entry[name] = {
                "cpu_seconds": seconds,
                "median": median,
                "gflop_per_s": 2 * args.rows * k * n / median / 1e9,
            }
        report["shapes"][f"{k}x{n}"] = entry
        print(
            f"{k:5d} -> {n:5d}: packed {entry['packed']['gflop_per_s']:.0f} GFLOP/s,"
            f" BLAS {entry['blas']['gflop_per_s']:.0f} GFLOP/s (one core)"
        )
    rate = {name: args.rows * flop_per_token / LAYERS / t for name, t in totals.items()}
    report["layer_gflop_per_s_one_core"] = {name: r / 1e9 for name, r in rate.items()}
    report["two_core_floor_seconds"] = {
        w: {name: tokens * flop_per_token / (2 * r) for name, r in rate.items()}
        for w, tokens in WORKLOAD_TOKENS.items()
    }
    for w, floors in report["two_core_floor_seconds"].items():
        print(
            f"{w}: {WORKLOAD_TOKENS[w]:,} tokens, products alone on two cores:"
            f" packed {floors['packed']:.2f} s, BLAS {floors['blas']:.2f} s"
        )
    if args.output:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main(sys.argv[1:])
