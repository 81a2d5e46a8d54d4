"""bf16 matrix products at a model's projection shapes, back to back, with the GPU's SM clock,
power and temperature read after each: how fast the card multiplies once it has been busy
for a while, against the first second (the ceiling `bench_gpu.py` measures for its MFU, also
taken here before the passes and after them).

    python benchmarks/lab/gemm_clocks.py --output benchmarks/results/gemm_clocks_h200.json

For each pass (`--passes`) and each projection of Qwen3-0.6B (q/k/v, gate/up, o, down; `x
[M, K] @ w.t()` as the engine's layers) at step sizes `--rows` (some a multiple of 256, some
not), the median of 5 timings of 20 products in TFLOP/s, then `nvidia-smi`'s clock, power draw
and temperature. The first pass starts on a card that idled; later passes on one that has run
the earlier ones.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks import record
from benchmarks.bench_gpu import matmul_ceiling

# Qwen3-0.6B's projections: (K, N).
SHAPES = {"qkv": (1024, 4096), "gate_up": (1024, 6144), "o": (2048, 1024), "down": (3072, 1024)}


def gpu_state() -> dict[str, float] | None:
    """The SM clock (MHz), power draw (W) and temperature (C) as nvidia-smi reads them now."""
    try:
        line = subprocess.run(
            ["nvidia-smi", "--query-gpu=clocks.sm,power.draw,temperature.gpu",
             "--format=csv,noheader,nounits", "-i", "0"],
            capture_output=True, text=True, timeout=10, check=True,
        ).stdout.splitlines()[0]  # fmt: skip
    except (OSError, subprocess.SubprocessError, IndexError):
        return None
    clock, power, temp = (float(v) for v in line.split(","))
    return {"sm_clock_mhz": clock, "power_w": power, "temperature_c": temp}


def timed(x: torch.Tensor, w: torch.Tensor) -> float:
    """Milliseconds per product: the median of 5 timings of 20."""
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(5):
        x @ w.t()
    times = []
    for _ in range(5):
        start.record()
        for _ in range(20):
            x @ w.t()
        stop.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(stop) / 20)
    return statistics.median(times)


def main(argv: list[str]) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[31517, 32768, 31488, 16411])
    parser.add_argument("--passes", type=int, default=3)
    parser.add_argument("--output", type=Path)
    record.add_args(parser)
    args = parser.parse_args(argv)
    report: dict[str, Any] = record.header(
        "lab/gemm_clocks.py", argv, device="cuda", commit=args.commit
    )
    report["idle_state"] = gpu_state()
    report["ceiling_tflops_before"] = matmul_ceiling(torch.device("cuda")) / 1e12
    report["state_after_ceiling"] = gpu_state()
    rows = []
    for p in range(args.passes):
        for name, (k, n) in SHAPES.items():
            w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
            for m in args.rows:
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                ms = timed(x, w)
                row = {"pass": p, "proj": name, "M": m, "K": k, "N": n, "ms": ms,
                       "tflops": 2 * m * k * n / ms / 1e9, **(gpu_state() or {})}  # fmt: skip
                rows.append(row)
                print(row, flush=True)
    report["rows"] = rows
    by_pass = {
        p: statistics.median(r["tflops"] for r in rows if r["pass"] == p)
        for p in range(args.passes)
    }
    report["median_tflops_by_pass"] = by_pass
    report["ceiling_tflops_after"] = matmul_ceiling(torch.device("cuda")) / 1e12
    report["state_at_end"] = gpu_state()
    print(
        "median TFLOP/s by pass:",
        {p: round(v) for p, v in by_pass.items()},
        f"ceiling before {report['ceiling_tflops_before']:.0f}, after "
        f"{report['ceiling_tflops_after']:.0f}",
        flush=True,
    )
    record.write(args.output, report)
    return report


if __name__ == "__main__":
    main(sys.argv[1:])
