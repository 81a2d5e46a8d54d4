"""FP8 against bf16 on a model with trained weights: the cosine of each embedding to bf16's.

    python benchmarks/lab/fp8_real.py --model-dir FOLDER --output fp8_real.json

Random weights (fp8_check.py) say how fast FP8 runs but not how faithful it is: a deep
random-weight network amplifies any rounding from layer to layer in a way trained networks do
not, so their bf16-to-FP8 cosines understate a real model's. This runs a real folder (e.g. the
packaged all-MiniLM-L6-v2) on bench_gpu.py's query and passage workloads (4,096 each, truncated
to the model's limit) three ways on one CUDA device — float32, bf16, and bf16 with
`quantization="fp8"` — and reports the minimum and median cosine of bf16 and FP8 to float32 and
of FP8 to bf16.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
import tokenizers

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks import record
from benchmarks.workloads import make_inputs, workload_lengths


def _cosines(a: np.ndarray, b: np.ndarray) -> dict[str, float]:
    cos = (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))
    return {"min": float(cos.min()), "median": float(np.median(cos))}


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model-dir", type=Path, help="default: the packaged MiniLM's folder")
    parser.add_argument("--n", type=int, default=4096)
    parser.add_argument("--output", type=Path)
    record.add_args(parser)
    args = parser.parse_args(argv)
    import vecpool
    from vecpool.api import default_model_path

    args.model_dir = args.model_dir or default_model_path()
    tokenizer = tokenizers.Tokenizer.from_file(str(args.model_dir / "tokenizer.json"))
    report: dict[str, Any] = {
        **record.header("lab/fp8_real.py", argv, device="cuda", commit=args.commit),
        "model": args.model_dir.name,
    }
    engines = {
        "float32": vecpool.Engine(args.model_dir, device="cuda", dtype="float32"),
        "bfloat16": vecpool.Engine(args.model_dir, device="cuda", dtype="bfloat16"),
        "fp8": vecpool.Engine(args.model_dir, device="cuda", dtype="bfloat16", quantization="fp8"),
    }
    for workload in ("queries", "passages"):
        _, ids = make_inputs(tokenizer, workload_lengths(workload, args.n))
        out = {
            name: e.embed(ids, truncate_prompt_tokens=-1, show_progress=False)
            for name, e in engines.items()
        }
        report[workload] = {
            "inputs": len(ids),
            "bf16_vs_fp32": _cosines(out["bfloat16"], out["float32"]),
            "fp8_vs_fp32": _cosines(out["fp8"], out["float32"]),
            "fp8_vs_bf16": _cosines(out["fp8"], out["bfloat16"]),
        }
        print(workload, report[workload], flush=True)
    record.write(args.output, report)
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main(sys.argv[1:])
