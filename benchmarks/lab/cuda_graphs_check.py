"""CUDA graphs on a device: the same calls with and without graphs (cosine), prompt embeds
against token ids (bit-exact), and the median latency of small `embed` calls either way.

    PYTHONPATH=. python benchmarks/lab/cuda_graphs_check.py --output cuda_graphs.json

Random-weight shapes of `bench_gpu.py` (Qwen3-0.6B, compiled; MiniLM, eager), inputs of its
queries workload (U[8, 64] tokens) and passages workload, text from `--tokenizer`'s vocabulary.
"""

from __future__ import annotations

import argparse
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
from benchmarks import record
from benchmarks.workloads import SHAPES, make_inputs, workload_lengths, write_folder
from vecpool.api.engine import default_model_path

CALL_SIZES = (1, 8, 32, 64, 256)


def check_shape(shape: str, tokenizer_dir: Path, repeats: int) -> dict[str, Any]:
    tokenizer = tokenizers.Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    tokenizer.no_truncation()
    tokenizer.no_padding()
    folder = write_folder(SHAPES[shape], Path(tempfile.mkdtemp()), tokenizer_dir, "cuda")
    _, queries = make_inputs(tokenizer, workload_lengths("queries", 512))
    _, passages = make_inputs(tokenizer, workload_lengths("passages", 64))
    engines = {g: vecpool.Engine(folder, device="cuda", cuda_graphs=g) for g in (False, True)}
    for engine in engines.values():
        engine.embed(queries[:256], show_progress=False)
    worst = 1.0
    for batch in (queries[:1], queries[:3], queries[:32], queries[:200], passages[:40]):
        a, b = (engines[g].embed(batch, show_progress=False) for g in (False, True))
        worst = min(worst, float((a * b).sum(1).min()))
    graphed = engines[True]
    as_ids = graphed.embed(queries[:24], show_progress=False)
    as_embeds = graphed.embed(
        [{"prompt_embeds": graphed.embed_tokens(p)} for p in queries[:24]], show_progress=False
    )
    report: dict[str, Any] = {
        "min_cosine_graphs_vs_none": worst,
        "embeds_equal_ids_bit_exact": bool(np.array_equal(as_ids, as_embeds)),
    }
    for g, engine in engines.items():
        for k in CALL_SIZES:
            times = []
            for r in range(repeats):
                torch.cuda.synchronize()
                start = time.perf_counter()
                engine.embed(queries[r : r + k], show_progress=False)
                times.append(time.perf_counter() - start)
            report[f"graphs={g} k={k} ms"] = statistics.median(times) * 1e3
            report[f"graphs={g} k={k} raw_ms"] = [t * 1e3 for t in times]
            print(f"{shape} graphs={g} k={k:4d} median {statistics.median(times) * 1e3:.2f} ms")
    graphs = graphed.model_runner.graphs
    assert graphs is not None
    report.update(recorded=len(graphs.graphs), replays=graphs.replays, enabled=graphs.enabled)
    print(shape, {k: v for k, v in report.items() if "ms" not in k})
    return report


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="+", default=["qwen3-0.6b", "minilm"])
    parser.add_argument("--tokenizer", type=Path, help="default: the packaged MiniLM's folder")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--output", type=Path)
    record.add_args(parser)
    args = parser.parse_args(argv)
    tokenizer_dir = args.tokenizer or default_model_path()
    report: dict[str, Any] = {
        **record.header("lab/cuda_graphs_check.py", argv, device="cuda", commit=args.commit),
        "shapes": {},
    }
    for s in args.shapes:
        report["shapes"][s] = check_shape(s, tokenizer_dir, args.repeats)
        record.write(args.output, report)


if __name__ == "__main__":
    main(sys.argv[1:])
