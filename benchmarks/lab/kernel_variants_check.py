"""Whether a step compiles a Triton kernel anew: the packed attention's and `qk_rotary`'s
compiled variants counted after the engine starts, after a warm-up call, and after each of a
few calls whose one eager step (above the graphs' 8,192 tokens) has a row count of another
kind (a multiple of 16, odd, even), each call timed.

    PYTHONPATH=. python benchmarks/lab/kernel_variants_check.py --tokenizer DIR --output FILE

Triton compiles a kernel for each kind of argument it specializes on: an integer's
divisibility by 16, a pointer's 16-byte alignment. A variant first needed in some later call
makes that call wait for the compiler (~0.7 s on an H200). CUDA graphs record the common
shapes at start (row counts of a multiple of 16, their own aligned buffers); the first eager
step compiles the kinds it needs; no later step should add one (`new_variants_after_warm_up`,
0 when none did). Qwen3-0.6B's shape, random weights, bf16, token ids.
"""

from __future__ import annotations

import argparse
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
from benchmarks.workloads import SHAPES, make_inputs, workload_lengths, write_folder
from vecpool.models.layers import packed_attention, qk_rotary


def variants() -> dict[str, int]:
    """Compiled variants of each kernel, over every device."""
    out = {}
    kernels = {"packed_attention": packed_attention._kernel(), "qk_rotary": qk_rotary._kernel()}
    for name, kernel in kernels.items():
        caches = getattr(kernel, "device_caches", {})
        out[name] = sum(len(cache[0]) for cache in caches.values())
    return out


def main(argv: list[str]) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokenizer", type=Path, required=True)
    parser.add_argument("--output", type=Path)
    record.add_args(parser)
    args = parser.parse_args(argv)
    report: dict[str, Any] = record.header(
        "lab/kernel_variants_check.py", argv, device="cuda", commit=args.commit
    )
    folder = write_folder(SHAPES["qwen3-0.6b"], Path(tempfile.mkdtemp()), args.tokenizer, "cuda")
    engine = vecpool.Engine(folder, device="cuda")
    tokenizer = tokenizers.Tokenizer.from_file(str(args.tokenizer / "tokenizer.json"))
    _, ids = make_inputs(tokenizer, workload_lengths("queries", 4096))
    report["after_start"] = variants()
    engine.embed(ids[:512], show_progress=False)
    torch.cuda.synchronize()
    report["after_warm_up_call"] = warm = variants()
    base = (ids[0] * 32)[:32]  # 32 tokens
    calls = {
        "9,600 rows (a multiple of 16)": [base] * 300,
        "9,633 rows (odd)": [base] * 300 + [[*base, base[1]]],
        "9,602 rows (even, not a multiple of 16)": [base] * 299 + [base[:2] * 17],
        "4,096 queries": ids,
    }
    rows = []
    for label, inputs in calls.items():
        torch.cuda.synchronize()
        started = time.perf_counter()
        engine.embed(inputs, show_progress=False)
        torch.cuda.synchronize()
        row = {"call": label, "seconds": time.perf_counter() - started, **variants()}
        rows.append(row)
        print(row, flush=True)
    report["rows"] = rows
    report["new_variants_after_warm_up"] = sum(rows[-1][name] - warm[name] for name in warm)
    print("new variants after the warm-up call:", report["new_variants_after_warm_up"])
    record.write(args.output, report)
    return report


if __name__ == "__main__":
    main(sys.argv[1:])
