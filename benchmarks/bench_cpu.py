"""vecpool against sentence-transformers on the CPU, in one process, on the same texts, in
interleaved rounds.

    python benchmarks/bench_cpu.py --output benchmarks/results/cpu_minilm_2core.json

The model is the packaged all-MiniLM-L6-v2 (`--model-dir` for another folder), float32. The
workloads are `bench_gpu.py`'s, fixed seed: **queries** of U[8, 64] tokens and **passages** of
lognormal(ln 180, 0.6) tokens clipped to [32, 512] (truncated to the model's 256 by both
sides), texts of whole-word vocabulary entries of the MiniLM tokenizer that are one token
each. Systems: `vecpool` (`Engine.embed` from text, the engine's CPU defaults, float32),
`vecpool-bf16` (the same, `dtype="bfloat16"`: opt-in, for CPUs with avx512_bf16 or AMX; its
lowest cosine to vecpool's float32 vectors is reported), `st-32` and `st-128`
(sentence-transformers `encode` at that batch size, float32).

On a small machine other work moves the timings by several times from one minute to the next,
so every round runs each system once on each workload, back to back, in an order that rotates
from round to round; a round's ratio is the reference's seconds over vecpool's in that round, and `st-best` is the faster of
the two sentence-transformers batch sizes in that round. The report keeps every timing, the
median tokens/s of each system, the median of the rounds' ratios, the load average around the
run, and the lowest cosine between the sides.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks import record
from benchmarks.bench_gpu import st_runner, vecpool_runner
from benchmarks.workloads import make_inputs, workload_lengths

SYSTEMS = ("vecpool", "vecpool-bf16", "st-32", "st-128")
OURS = ("vecpool", "vecpool-bf16")


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
    record.add_args(parser)
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
        if s in OURS:
            runs[s], _ = vecpool_runner(
                folder,
                "cpu",
                "bfloat16" if s == "vecpool-bf16" else "float32",
                text=True,
                compile=None,
                budget=args.max_num_batched_tokens,
            )
        else:
            runs[s], _ = st_runner(folder, "cpu", torch.float32, int(s.removeprefix("st-")))
    report: dict[str, Any] = {
        **record.header(
            "bench_cpu.py", sys.argv[1:] if argv is None else argv, device="cpu", commit=args.commit
        ),
        "cpu_flags": cpu_flags(),
        "model": str(folder.name if args.model_dir else "all-MiniLM-L6-v2 (packaged)"),
        "max_seq_length": limit,
        # glibc's allocator settings, when given (they change how often big tensors fault).
        "malloc_environment": {k: v for k, v in os.environ.items() if k.startswith("MALLOC_")},
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
    record.write(args.output, report)
    return report


def cpu_flags() -> list[str]:
    """The CPU's vector-unit flags that matter here (avx512*, amx*), from /proc/cpuinfo."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return []
    flags = next(
        (line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")),
        [],
    )
    return sorted(f for f in flags if f.startswith(("avx512", "amx")))


def min_cosine(a: np.ndarray, b: np.ndarray) -> float:
    cos = np.sum(a * b, axis=1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))
    return float(cos.min())


def summarize(report: dict[str, Any], outputs: dict[str, dict[str, np.ndarray]]) -> dict[str, Any]:
    """Median tokens/s of each system, the median of the rounds' ratios of each of ours to
    each reference and to the faster reference of each round (`st-best`), and the lowest
    cosines: each of ours against each reference, bfloat16 against float32."""
    out: dict[str, Any] = {"tokens_per_s_median": {}, "ratio_median": {}, "lines": []}
    for w, by_system in report["seconds"].items():
        tokens = report["workloads"][w]["num_tokens"]
        out["tokens_per_s_median"][w] = {
            s: tokens / statistics.median(sec) for s, sec in by_system.items()
        }
        out["lines"].append(
            f"{w:8s} "
            + "  ".join(f"{s} {v:,.0f} tok/s" for s, v in out["tokens_per_s_median"][w].items())
        )
        theirs = {s: sec for s, sec in by_system.items() if s not in OURS}
        if len(theirs) > 1:  # each round's faster reference
            theirs["st-best"] = [min(t) for t in zip(*theirs.values(), strict=True)]
        for ours in (s for s in OURS if s in by_system):
            line = f"{'':8s} {ours}:"
            for s, sec in theirs.items():
                ratios = [t / m for t, m in zip(sec, by_system[ours], strict=True)]
                out["ratio_median"].setdefault(w, {}).setdefault(ours, {})[s] = statistics.median(
                    ratios
                )
                line += f"  / {s} {statistics.median(ratios):.2f}x"
                if s != "st-best":
                    cosine = min_cosine(outputs[w][ours], outputs[w][s])
                    report["fidelity"][f"{w}_{ours}_vs_{s}_min_cosine"] = cosine
                    diff = float(np.abs(outputs[w][ours] - outputs[w][s]).max())
                    report["fidelity"][f"{w}_{ours}_vs_{s}_max_abs_diff"] = diff
            if ours != "vecpool" and "vecpool" in by_system:
                cosine = min_cosine(outputs[w][ours], outputs[w]["vecpool"])
                report["fidelity"][f"{w}_{ours}_vs_vecpool_min_cosine"] = cosine
                line += f"  (min cosine to float32 {cosine:.5f})"
            out["lines"].append(line)
    return out


if __name__ == "__main__":
    main(sys.argv[1:])
