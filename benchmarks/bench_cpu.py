"""vecpool against sentence-transformers on the CPU, in one process, on the same texts, in
interleaved rounds.

    python benchmarks/bench_cpu.py --output benchmarks/results/cpu_minilm_2core.json

The model is the packaged all-MiniLM-L6-v2 (`--model-dir` for another folder), float32. The
workloads are `bench_gpu.py`'s, fixed seed: **queries** of U[8, 64] tokens and **passages** of
lognormal(ln 180, 0.6) tokens clipped to [32, 512] (truncated to the model's 256 by both
sides), texts of whole-word vocabulary entries of the MiniLM tokenizer that are one token
each. Systems: `vecpool` (`Engine.embed` from text, the engine's CPU defaults), `st-32` and
`st-128` (sentence-transformers `encode` at that batch size).

On a small machine other work moves the timings by several times from one minute to the next,
so every round runs each system once on each workload, back to back, in an order that rotates
from round to round; a round's ratio is the reference's seconds over vecpool's in that round.
The report keeps every timing, the median tokens/s of each system, the median of the rounds'
ratios, the load average around the run, and the lowest cosine between the two sides.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.bench_gpu import (
    git_commit,
    make_inputs,
    st_runner,
    vecpool_runner,
    workload_lengths,
)

SYSTEMS = ("vecpool", "st-32", "st-128")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model-dir", type=Path, help="default: the packaged MiniLM")
    parser.add_argument("--queries", type=int, default=1024, help="query inputs")
    parser.add_argument("--passages", type=int, default=256, help="passage inputs")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--systems", nargs="+", default=list(SYSTEMS), choices=SYSTEMS)
    parser.add_argument("--max-num-batched-tokens", type=int, help="vecpool's step budget")
    parser.add_argument("--threads", type=int, help="torch.set_num_threads (default: torch's)")
    parser.add_argument("--output", type=Path, help="write the report here as JSON")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    import tokenizers

    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    folder = args.model_dir
    if folder is None:
        from vecpool.api import default_model_path

        folder = default_model_path()
    tokenizer = tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json"))
    tokenizer.no_truncation()
    tokenizer.no_padding()
    limit = json.loads((folder / "sentence_bert_config.json").read_text())["max_seq_length"]
    inputs: dict[str, tuple[list[str], list[list[int]], np.ndarray]] = {}
    for w, n in (("queries", args.queries), ("passages", args.passages)):
        if n > 0:
            lengths = workload_lengths(w, n)
            texts, ids = make_inputs(tokenizer, lengths)
            inputs[w] = (texts, ids, np.minimum(lengths, limit))  # the tokens that run

    runs = {}
    for s in args.systems:
        if s == "vecpool":
            runs[s], _ = vecpool_runner(
                folder,
                "cpu",
                "float32",
                text=True,
                compile=None,
                budget=args.max_num_batched_tokens,
            )
        else:
            runs[s], _ = st_runner(folder, "cpu", torch.float32, int(s.removeprefix("st-")))
    report: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{os.cpu_count()}-core CPU ({platform.processor() or platform.machine()})",
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "commit": git_commit(),
        "command": "python benchmarks/bench_cpu.py " + " ".join(argv or []),
        "model": str(folder.name if args.model_dir else "all-MiniLM-L6-v2 (packaged)"),
        "max_seq_length": limit,
        # glibc's allocator settings, when given (they change how often big tensors fault).
        "malloc_environment": {k: v for k, v in os.environ.items() if k.startswith("MALLOC_")},
        "load_average_at_start": os.getloadavg(),
        "workloads": {
            w: {"num_inputs": len(v[0]), "num_tokens": int(v[2].sum())} for w, v in inputs.items()
        },
        "seconds": {w: {s: [] for s in runs} for w in inputs},
        "fidelity": {},
    }
    outputs: dict[str, dict[str, np.ndarray]] = {w: {} for w in inputs}
    for w, (texts, ids, _) in inputs.items():  # warm-up, and the outputs compared
        for s, run in runs.items():
            outputs[w][s] = run(texts, ids)
    order = list(runs)
    for r in range(args.rounds):
        for w, (texts, ids, _) in inputs.items():
            for s in order[r % len(order) :] + order[: r % len(order)]:
                start = time.perf_counter()
                runs[s](texts, ids)
                report["seconds"][w][s].append(time.perf_counter() - start)
        print(f"round {r + 1}/{args.rounds}: load {os.getloadavg()[0]:.1f}", flush=True)
    report["load_average_at_end"] = os.getloadavg()
    report["summary"] = summarize(report, outputs)
    for line in report["summary"]["lines"]:
        print(line)
    if args.output:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps(report, indent=1) + "\n")
    return report


def summarize(report: dict[str, Any], outputs: dict[str, dict[str, np.ndarray]]) -> dict[str, Any]:
    """Median tokens/s of each system, and the median of the rounds' ratios to vecpool."""
    out: dict[str, Any] = {"tokens_per_s_median": {}, "ratio_median": {}, "lines": []}
    for w, by_system in report["seconds"].items():
        tokens = report["workloads"][w]["num_tokens"]
        out["tokens_per_s_median"][w] = {
            s: tokens / statistics.median(sec) for s, sec in by_system.items()
        }
        line = f"{w:8s} " + "  ".join(
            f"{s} {v:,.0f} tok/s" for s, v in out["tokens_per_s_median"][w].items()
        )
        if "vecpool" in by_system:
            ours = by_system["vecpool"]
            for s, sec in by_system.items():
                if s == "vecpool":
                    continue
                ratios = [theirs / mine for theirs, mine in zip(sec, ours, strict=True)]
                out["ratio_median"].setdefault(w, {})[s] = statistics.median(ratios)
                a, b = outputs[w]["vecpool"], outputs[w][s]
                cos = np.sum(a * b, axis=1) / (
                    np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1)
                )
                report["fidelity"][f"{w}_vs_{s}_min_cosine"] = float(cos.min())
                line += f"  | vecpool / {s}: {statistics.median(ratios):.2f}x"
        out["lines"].append(line)
    return out


if __name__ == "__main__":
    main(sys.argv[1:])
