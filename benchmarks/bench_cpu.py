"""vecpool against sentence-transformers on the CPU, on the same texts, in interleaved rounds,
under the CPU's own instruction set and capped at AVX2.

    python benchmarks/bench_cpu.py --output benchmarks/results/cpu_minilm_2core.json

Each instruction set runs in a process of its own (`--isa`, default both): `native` with the
caps below unset, `avx2` with `ONEDNN_MAX_CPU_ISA=AVX2`, `MKL_ENABLE_INSTRUCTIONS=AVX2` and
`ATEN_CPU_CAPABILITY=avx2`, and `FBGEMM_ENABLE_INSTRUCTIONS=AVX2` for int8 (read when torch
loads, hence the process), as an AVX2-only CPU runs
(bfloat16 is left out there: it needs avx512_bf16 or AMX). The report keeps, per instruction
set, the caps it ran under, torch's CPU capability, the engine's per-machine choice as it
logged it (`vecpool/runner/cpu_choice.py`), every round's timings and its summary; `rounds`
lists every round with its caps. `--fresh-choice` has each process measure the engine's choice
anew (a cache folder of its own) rather than reading the user's cached one.

The model is the packaged all-MiniLM-L6-v2 (`--model-dir` for another folder), float32. The
workloads are `bench_gpu.py`'s, fixed seed: **queries** of U[8, 64] tokens and **passages** of
lognormal(ln 180, 0.6) tokens clipped to [32, 512] (truncated to the model's 256 by both
sides), texts of whole-word vocabulary entries of the MiniLM tokenizer that are one token
each. Systems: `vecpool` (`Engine.embed` from text, the engine's CPU defaults, float32),
`vecpool-bf16` (the same, `dtype="bfloat16"`: opt-in, for CPUs with avx512_bf16 or AMX),
`vecpool-int8` (float32 with `quantization="int8"`; both report their lowest and median cosine
to vecpool's float32 vectors), `st-32` and `st-128`
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
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks import record
from benchmarks.bench_gpu import st_runner, vecpool_runner
from benchmarks.workloads import make_inputs, workload_lengths

SYSTEMS = ("vecpool", "vecpool-bf16", "vecpool-int8", "st-32", "st-128")
OURS = ("vecpool", "vecpool-bf16", "vecpool-int8")
# The environment of each instruction set's process: `native` runs with these unset.
CAPS = {
    "native": {},
    "avx2": {
        "ONEDNN_MAX_CPU_ISA": "AVX2",
        "MKL_ENABLE_INSTRUCTIONS": "AVX2",
        "ATEN_CPU_CAPABILITY": "avx2",
        # FBGEMM (int8) reads the CPU's flags itself; only this caps it
        "FBGEMM_ENABLE_INSTRUCTIONS": "AVX2",
    },
}
CAP_NAMES = tuple(CAPS["avx2"])
# The float32 targets: the median ratio to the better sentence-transformers batch size.
TARGETS = {"native": 1.3, "avx2": 1.25}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model-dir", type=Path, help="default: the packaged MiniLM")
    parser.add_argument("--queries", type=int, default=1024, help="query inputs")
    parser.add_argument("--passages", type=int, default=256, help="passage inputs")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--systems", nargs="+", default=list(SYSTEMS), choices=SYSTEMS)
    parser.add_argument("--max-num-batched-tokens", type=int, help="vecpool's step budget")
    parser.add_argument("--threads", type=int, help="torch.set_num_threads (default: torch's)")
    parser.add_argument("--isa", nargs="+", default=list(CAPS), choices=list(CAPS))
    parser.add_argument(
        "--fresh-choice", action="store_true", help="measure the engine's CPU choice anew"
    )
    parser.add_argument("--output", type=Path, help="write the report here as JSON")
    # Internal: run one instruction set in this process (the caller set its environment).
    parser.add_argument("--one-isa", choices=list(CAPS), help=argparse.SUPPRESS)
    record.add_args(parser)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Each instruction set in its own process, one after the other; their reports merged."""
    args = parse_args(argv)
    if args.one_isa:
        part = run_isa(args)
        record.write(args.output, part)
        return part
    report: dict[str, Any] = {
        **record.header(
            "bench_cpu.py", sys.argv[1:] if argv is None else argv, device="cpu", commit=args.commit
        ),
        "cpu_flags": cpu_flags(),
        "targets_float32_vs_st_best": {isa: TARGETS[isa] for isa in args.isa},
        "isas": {},
        "rounds": [],
    }
    with tempfile.TemporaryDirectory() as tmp:
        for isa in args.isa:
            out = Path(tmp) / f"{isa}.json"
            env = {k: v for k, v in os.environ.items() if k not in CAP_NAMES}
            env.update(CAPS[isa])
            if args.fresh_choice:
                env["VECPOOL_CACHE_DIR"] = str(Path(tmp) / f"choice-{isa}")
            command = [sys.executable, str(Path(__file__).resolve()), *child_args(args, isa)]
            subprocess.run([*command, "--output", str(out)], env=env, check=True)
            part = json.loads(out.read_text())
            report["isas"][isa] = part
            report["rounds"] += [
                {"isa": isa, "caps": part["caps"], **r} for r in part.pop("rounds")
            ]
    for key in ("model", "max_seq_length", "workloads"):
        report[key] = report["isas"][args.isa[0]][key]
    report["summary"] = {"lines": [], "float32_vs_st_best": {}}
    for isa, part in report["isas"].items():
        lines = report["summary"]["lines"]
        lines.append(f"{isa} ({part['cpu_capability']}, caps {part['caps'] or 'none'}):")
        lines += ["  " + line for line in part["cpu_choice"] + part["summary"]["lines"]]
        ratios = {
            w: by["vecpool"]["st-best"]
            for w, by in part["summary"]["ratio_median"].items()
            if "st-best" in by.get("vecpool", {})
        }
        report["summary"]["float32_vs_st_best"][isa] = ratios
        if ratios:
            lines.append(
                f"  float32 / st-best, median of rounds (target {TARGETS[isa]}x): "
                + ", ".join(f"{w} {r:.2f}x" for w, r in ratios.items())
            )
    report["load_average_at_end"] = os.getloadavg()
    for line in report["summary"]["lines"]:
        print(line)
    record.write(args.output, report)
    return report


def child_args(args: argparse.Namespace, isa: str) -> list[str]:
    """The command line of one instruction set's process."""
    systems = [s for s in args.systems if isa == "native" or s != "vecpool-bf16"]
    out = ["--one-isa", isa, "--queries", str(args.queries), "--passages", str(args.passages)]
    out += ["--rounds", str(args.rounds), "--systems", *systems]
    if args.model_dir:
        out += ["--model-dir", str(args.model_dir)]
    if args.max_num_batched_tokens:
        out += ["--max-num-batched-tokens", str(args.max_num_batched_tokens)]
    if args.threads:
        out += ["--threads", str(args.threads)]
    return out


class _Choices(logging.Handler):
    """Keeps what the engine logs about its CPU choice."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def run_isa(args: argparse.Namespace) -> dict[str, Any]:
    """Every system on every workload in `args.rounds` interleaved rounds, in this process
    (under the instruction set its environment gives)."""
    import tokenizers

    choices = _Choices()
    choice_logger = logging.getLogger("vecpool.runner.cpu_choice")
    choice_logger.addHandler(choices)
    choice_logger.setLevel(logging.INFO)
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
            runs[s] = ours_runner(s, folder, args.max_num_batched_tokens)
        else:
            runs[s], _ = st_runner(folder, "cpu", torch.float32, int(s.removeprefix("st-")))
    report: dict[str, Any] = {
        "caps": {k: os.environ[k] for k in CAP_NAMES if k in os.environ},
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "threads": torch.get_num_threads(),
        "cpu_choice": choices.lines,
        "model": str(folder.name if args.model_dir else "all-MiniLM-L6-v2 (packaged)"),
        "max_seq_length": limit,
        # glibc's allocator settings, when given (they change how often big tensors fault).
        "malloc_environment": {k: v for k, v in os.environ.items() if k.startswith("MALLOC_")},
        "workloads": {
            w: {"num_inputs": len(v[0]), "num_tokens": int(v[2].sum())} for w, v in inputs.items()
        },
        "seconds": {w: {s: [] for s in runs} for w in inputs},
        "rounds": [],
        "fidelity": {},
    }
    outputs: dict[str, dict[str, np.ndarray]] = {w: {} for w in inputs}
    for w, (texts, ids, _) in inputs.items():  # warm-up, and the outputs compared
        for s, run in runs.items():
            outputs[w][s] = run(texts, ids)
    order = list(runs)
    for r in range(args.rounds):
        this_round: dict[str, dict[str, float]] = {w: {} for w in inputs}
        for w, (texts, ids, _) in inputs.items():
            for s in order[r % len(order) :] + order[: r % len(order)]:
                start = time.perf_counter()
                runs[s](texts, ids)
                this_round[w][s] = time.perf_counter() - start
                report["seconds"][w][s].append(this_round[w][s])
        load = os.getloadavg()[0]
        report["rounds"].append({"round": r + 1, "load_average": load, "seconds": this_round})
        print(f"{args.one_isa} round {r + 1}/{args.rounds}: load {load:.1f}", flush=True)
    report["load_average_at_end"] = os.getloadavg()
    report["summary"] = summarize(report, outputs)
    return report


def ours_runner(system: str, folder: Path, budget: int | None) -> Any:
    """One of vecpool's systems: float32, `-bf16` (dtype bfloat16), `-int8` (float32 with
    `quantization="int8"`: int8 linears, attention and norms in float32)."""
    run, _ = vecpool_runner(
        folder,
        "cpu",
        "bfloat16" if system == "vecpool-bf16" else "float32",
        text=True,
        compile=None,
        budget=budget,
        quantization="int8" if system == "vecpool-int8" else None,
    )
    return run


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


def median_cosine(a: np.ndarray, b: np.ndarray) -> float:
    cos = np.sum(a * b, axis=1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))
    return float(np.median(cos))


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
                median = median_cosine(outputs[w][ours], outputs[w]["vecpool"])
                report["fidelity"][f"{w}_{ours}_vs_vecpool_median_cosine"] = median
                line += f"  (cosine to float32: min {cosine:.5f}, median {median:.5f})"
            out["lines"].append(line)
    return out


if __name__ == "__main__":
    main(sys.argv[1:])
