"""The batch-invariant mode's Triton matmul (`vecpool.models.layers.invariant`) on one GPU:
launch configurations against cuBLAS on the Qwen3-0.6B shape's projections, and the invariance
each keeps (a row's bits the same alone, in a batch of 7 and in a batch of 300).

    python benchmarks/lab/invariant_matmul_check.py --output benchmarks/results/x.json

For each configuration: milliseconds of each projection at M = 8,192 and 512 rows (bf16,
`triton.testing.do_bench`, median), their sum over the four projections of a layer against
cuBLAS's (`F.linear`), the largest difference to cuBLAS relative to its largest magnitude, and
whether every row was bit-equal across the three batches. The configuration the engine runs is
`TRITON_CONFIG`; "now" is what it was when this check was written.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks import record
from vecpool.models.layers.invariant import TRITON_CONFIG, triton_linear

# (name, N, K) of Qwen3-0.6B's projections: q/k/v, o, gate/up, down
SHAPES = [("qkv", 4096, 1024), ("o", 1024, 2048), ("gate_up", 6144, 1024), ("down", 1024, 3072)]
ROWS = (8192, 512)


def _config(bm: int, bn: int, bk: int, warps: int, stages: int, rows: bool) -> dict[str, Any]:
    return dict(
        BLOCK_M=bm,
        BLOCK_N=bn,
        BLOCK_K=bk,
        GROUP_M=8,
        num_warps=warps,
        num_stages=stages,
        W_ROWS=rows,
    )


CONFIGS: dict[str, dict[str, Any]] = {
    "now": _config(128, 128, 64, 8, 3, False),
    "engine": dict(TRITON_CONFIG),
    "rows 128x128x64 w8 s3": _config(128, 128, 64, 8, 3, True),
    "rows 128x128x64 w4 s4": _config(128, 128, 64, 4, 4, True),
    "rows 128x256x64 w8 s3": _config(128, 256, 64, 8, 3, True),
    "rows 128x256x64 w8 s4": _config(128, 256, 64, 8, 4, True),
    "rows 64x256x64 w4 s4": _config(64, 256, 64, 4, 4, True),
    "rows 128x128x128 w8 s3": _config(128, 128, 128, 8, 3, True),
    "rows 256x128x64 w8 s3": _config(256, 128, 64, 8, 3, True),
}


def invariant(config: dict[str, Any], weight: torch.Tensor, x: torch.Tensor) -> bool:
    """Whether each of the first 7 rows has the same bits alone, among 7 and among all."""
    whole = triton_linear(x, weight, None, config)
    seven = triton_linear(x[:7].contiguous(), weight, None, config)
    alone = torch.cat([triton_linear(x[i : i + 1], weight, None, config) for i in range(7)])
    return bool(torch.equal(whole[:7], seven) and torch.equal(seven, alone))


def main(argv: list[str]) -> dict[str, Any]:
    from triton.testing import do_bench

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--output", type=Path)
    record.add_args(parser)
    args = parser.parse_args(argv)
    report: dict[str, Any] = {
        **record.header("lab/invariant_matmul_check.py", argv, device="cuda", commit=args.commit),
        "shapes": SHAPES,
        "configs": {},
    }
    torch.manual_seed(0)
    device = torch.device("cuda")
    weights = {
        n: torch.randn(out, k, device=device, dtype=torch.bfloat16) / k**0.5 for n, out, k in SHAPES
    }
    inputs = {
        (m, k): torch.randn(m, k, device=device, dtype=torch.bfloat16)
        for m in ROWS
        for _, _, k in SHAPES
    }
    cublas: dict[str, float] = {}
    for name, _, k in SHAPES:
        for m in ROWS:
            x = inputs[(m, k)]
            cublas[f"{name}/{m}"] = do_bench(lambda x=x, w=weights[name]: F.linear(x, w))
    report["cublas_ms"] = cublas
    for label, config in CONFIGS.items():
        entry: dict[str, Any] = {"config": config, "ms": {}}
        try:
            worst, same = 0.0, True
            for name, _, k in SHAPES:
                w = weights[name]
                for m in ROWS:
                    x = inputs[(m, k)]
                    entry["ms"][f"{name}/{m}"] = do_bench(
                        lambda x=x, w=w, c=config: triton_linear(x, w, None, c)
                    )
                x = inputs[(512, k)][:300].contiguous()
                ref = F.linear(x, w).float()
                got = triton_linear(x, w, None, config).float()
                worst = max(worst, float((got - ref).abs().max() / ref.abs().max()))
                same = same and invariant(config, w, x)
            entry["max_rel_diff_to_cublas"] = worst
            entry["invariant"] = same
            for m in ROWS:
                ours = sum(entry["ms"][f"{n}/{m}"] for n, _, _ in SHAPES)
                theirs = sum(cublas[f"{n}/{m}"] for n, _, _ in SHAPES)
                entry[f"layer_ms_{m}"] = ours
                entry[f"cublas_over_ours_{m}"] = theirs / ours
            print(
                f"{label:26s} M=8192 {entry['layer_ms_8192']:.3f} ms "
                f"({entry['cublas_over_ours_8192']:.2f} of cuBLAS's speed), M=512 "
                f"{entry['layer_ms_512']:.3f} ms ({entry['cublas_over_ours_512']:.2f}); "
                f"invariant {same}, max rel diff {worst:.1e}",
                flush=True,
            )
        except Exception as exc:  # a configuration the GPU cannot run (shared memory)
            entry["error"] = f"{type(exc).__name__}: {exc}"
            print(f"{label:26s} {entry['error'][:200]}", flush=True)
        report["configs"][label] = entry
    if args.output is not None:
        record.write(args.output, report)
    return report


if __name__ == "__main__":
    main(sys.argv[1:])
