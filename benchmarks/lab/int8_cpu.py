"""int8 on the CPU against float32: the MiniLM projection shapes, then the engine end to end,
in interleaved rounds.

    python benchmarks/lab/int8_cpu.py --output benchmarks/results/int8_cpu.json

(a) **matmul**: `[M, K] x [K, N]` for MiniLM's projections (q/k/v fused 384 -> 1152, o
    384 -> 384, up 384 -> 1536, down 1536 -> 384) at M = 4096: float32 `F.linear`,
    `torch._int_mm` alone, and the whole `Int8Linear` (per-token quantization, int8 product,
    scaling), milliseconds per call, the best and the median of `--rounds` rounds.
(b) **engine**: the packaged all-MiniLM-L6-v2 from token ids on bench_gpu.py's workloads
    (queries, passages), float32 and `quantization="int8"` (with `--compile`, each also with
    torch.compile, which fuses the quantization's elementwise passes), timed in each round
    in alternating order (other work on a small machine moves timings from minute to minute);
    tokens/s per round and the medians, and the lowest cosine of int8 to float32.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks import record
from benchmarks.workloads import make_inputs, workload_lengths

SHAPES = {"qkv": (384, 1152), "o": (384, 384), "up": (384, 1536), "down": (1536, 384)}


def ms(fn: Callable[[], object], iters: int) -> float:
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - start) / iters * 1e3


def bench_matmuls(rounds: int, m: int) -> list[dict[str, Any]]:
    from vecpool.models.quant.linear import Int8Linear
    from vecpool.models.quant.quantize import quantize_rows

    rows = []
    for name, (k, n) in SHAPES.items():
        gen = torch.Generator().manual_seed(0)
        x, w = torch.randn(m, k, generator=gen), torch.randn(n, k, generator=gen) * 0.05
        layer = Int8Linear(w, None, None)
        q = quantize_rows(x, torch.int8)
        weight_t = layer.weight.t().contiguous()  # [K, N] int8: torch._int_mm's fastest layout
        fns = {
            "fp32": lambda x=x, w=w: F.linear(x, w),
            "int_mm_only": lambda q=q, weight_t=weight_t: torch._int_mm(q.data, weight_t),
            "int8_layer": lambda x=x, layer=layer: layer(x),
        }
        row: dict[str, Any] = {"proj": name, "M": m, "K": k, "N": n}
        for fn in fns.values():  # warm up
            fn()
        raw: dict[str, list[float]] = {label: [] for label in fns}
        for _ in range(rounds):  # interleaved: each round times every variant
            for label, fn in fns.items():
                raw[label].append(ms(fn, 5))
        for label, values in raw.items():
            row[label] = {
                "ms": values,
                "best_ms": min(values),
                "median_ms": statistics.median(values),
            }
        row["speedup_int8_layer"] = row["fp32"]["median_ms"] / row["int8_layer"]["median_ms"]
        rows.append(row)
        print(
            f"{name}: fp32 {row['fp32']['median_ms']:.2f} ms, _int_mm "
            f"{row['int_mm_only']['median_ms']:.2f}, Int8Linear {row['int8_layer']['median_ms']:.2f}",
            flush=True,
        )
    return rows


def bench_engine(args: argparse.Namespace) -> dict[str, Any]:
    import tokenizers

    import vecpool
    from vecpool.api import default_model_path

    folder = default_model_path()
    tokenizer = tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json"))
    tokenizer.no_truncation()
    tokenizer.no_padding()
    workloads = {
        "queries": make_inputs(tokenizer, workload_lengths("queries", args.queries))[1],
        "passages": make_inputs(tokenizer, workload_lengths("passages", args.passages))[1],
    }
    engines = {}
    for compile in (False, True) if args.compile else (False,):
        for q in (None, "int8"):
            name = (q or "fp32") + ("-compiled" if compile else "")
            engines[name] = vecpool.Engine(folder, device="cpu", quantization=q, compile=compile)
    out: dict[str, Any] = {"rows": [], "cosine": {}}
    for name, ids in workloads.items():
        tokens = sum(min(len(i), 256) for i in ids)
        raw: dict[str, list[float]] = {s: [] for s in engines}
        vectors: dict[str, np.ndarray] = {}
        for e in engines.values():
            e.embed(ids[:32], truncate_prompt_tokens=-1, show_progress=False)
        for r in range(args.rounds):
            order = list(engines) if r % 2 == 0 else list(reversed(engines))
            for system in order:
                start = time.perf_counter()
                vec = engines[system].embed(ids, truncate_prompt_tokens=-1, show_progress=False)
                raw[system].append(tokens / (time.perf_counter() - start))
                vectors[system] = np.asarray(vec)
        for system, values in raw.items():
            row = {
                "system": system,
                "workload": name,
                "tokens": tokens,
                "tokens_per_s": values,
                "median_tokens_per_s": statistics.median(values),
            }
            out["rows"].append(row)
            print(f"{system} {name}: {row['median_tokens_per_s']:.0f} tok/s {values}", flush=True)
        cos = np.sum(vectors["fp32"] * vectors["int8"], axis=1)  # both normalized
        if "int8-compiled" in vectors:
            compiled = np.sum(vectors["fp32"] * vectors["int8-compiled"], axis=1)
            out["cosine"][name + "-compiled"] = {"min": float(compiled.min())}
        out["cosine"][name] = {"min": float(cos.min()), "median": float(np.median(cos))}
        print(f"cosine {name}: {out['cosine'][name]}", flush=True)
    return out


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--m", type=int, default=4096, help="rows of the matmul benchmark")
    parser.add_argument("--queries", type=int, default=1024)
    parser.add_argument("--passages", type=int, default=256)
    parser.add_argument(
        "--compile", action="store_true", help="also both engines compiled (torch.compile)"
    )
    parser.add_argument("--threads", type=int, help="torch.set_num_threads (default: torch's)")
    parser.add_argument("--output", type=Path)
    record.add_args(parser)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    report: dict[str, Any] = {
        **record.header("lab/int8_cpu.py", argv, device="cpu", commit=args.commit),
    }
    report["matmul"] = bench_matmuls(args.rounds, args.m)
    report["engine"] = bench_engine(args)
    report["load_average_at_end"] = list(os.getloadavg())
    record.write(args.output, report)


if __name__ == "__main__":
    main(sys.argv[1:])
