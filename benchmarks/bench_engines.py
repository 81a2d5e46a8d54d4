"""Several engines in one process: each engine's throughput beside the others against its own
throughput alone.

    PYTHONPATH=. python benchmarks/bench_engines.py --device cuda --shape qwen3-0.6b \
        --engines bf16 fp8 --output benchmarks/results/engines_together_qwen3-0.6b_h100.json

A model of `--shape` (random weights, the packaged MiniLM tokenizer, as `bench_gpu.py` writes
it) is served by each of `--engines` (`bf16`, `fp16`, `fp32`, or `fp8`: bfloat16 with FP8
products), each on `--workloads` given as token ids and as texts.
- **alone**: each engine in a process of its own (this script again, `--child`): built, warmed
  once at full size, then `--repeats` timed rounds;
- **together**: every engine built in this one process, in the order given, each warmed at full
  size; then the rounds, engine after engine within each round, so every engine runs while the
  others are built and idle beside it, as a user's second engine would be.
Reported: every round's seconds, the medians, tokens/s and each engine's together / alone ratio
per workload and input form. Where the time went, per engine and round: the host CPU seconds the
process spent (`time.process_time`), the steps served by CUDA graphs, and torch.compile's frames
and recompiles (a recompile in a timed round means a warm engine compiled again). The script
exits non-zero if an engine's outputs together differ from its outputs alone by more than the
dtype's rounding (`--atol`), which would mean the engines share state that changes results.
"""

from __future__ import annotations

import argparse
import gc
import json
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
from benchmarks.workloads import SHAPES, make_inputs, workload_lengths, write_folder

ENGINES: dict[str, dict[str, Any]] = {
    "bf16": {"dtype": "bfloat16"},
    "fp16": {"dtype": "float16"},
    "fp32": {"dtype": "float32"},
    "fp8": {"dtype": "bfloat16", "quantization": "fp8"},
}
FORMS = ("ids", "text")


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="minilm")
    parser.add_argument("--engines", nargs="+", choices=sorted(ENGINES), default=["fp32", "fp32"])
    parser.add_argument("--workloads", nargs="+", default=["queries", "passages"])
    parser.add_argument("--n", type=int, default=4096, help="inputs per workload")
    parser.add_argument("--repeats", type=int, default=3, help="timed rounds (at least 3)")
    parser.add_argument("--compile", choices=("auto", "on", "off"), default="auto")
    parser.add_argument(
        "--profile",
        action="store_true",
        help="after the rounds, each engine's first workload from text once under torch.profiler,"
        " alone and together: the operators that took the most host and device time",
    )
    parser.add_argument(
        "--shared-code",
        action="store_true",
        help="engines of one block class share its compiled code (the baseline of "
        "`vecpool.runner.compiled.OWN_CODE`)",
    )
    parser.add_argument("--atol", type=float, default=0.0, help="largest difference allowed")
    parser.add_argument("--output", type=Path)
    parser.add_argument("--tokenizer", type=Path, help="default: the packaged model's folder")
    parser.add_argument("--child", type=int, help=argparse.SUPPRESS)  # index into --engines
    parser.add_argument("--folder", type=Path, help=argparse.SUPPRESS)
    record.add_args(parser)
    args = parser.parse_args(argv)
    if args.repeats < record.MIN_ROUNDS:
        parser.error(f"--repeats must be at least {record.MIN_ROUNDS}")
    return args


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _dynamo() -> dict[str, int]:
    """torch.compile's process-wide counts so far: compiled frames, recompiles."""
    from torch._dynamo.utils import counters

    return {
        "frames": int(counters["frames"]["total"]),
        "recompiles": int(sum(counters["recompiles"].values())),
    }


class Subject:
    """One engine of the benchmark and its inputs."""

    def __init__(self, name: str, folder: Path, args: argparse.Namespace):
        import vecpool

        compile = {"auto": None, "on": True, "off": False}[args.compile]
        self.name = name
        self.device = torch.device(args.device)
        self.engine = vecpool.Engine(folder, device=args.device, compile=compile, **ENGINES[name])

    def graph_replays(self) -> int:
        graphs = getattr(self.engine.model_runner, "graphs", None)
        return int(getattr(graphs, "replays", 0) or 0)

    def run(self, inputs: list[Any]) -> np.ndarray:
        return np.asarray(self.engine.embed(inputs, truncate_prompt_tokens=-1, show_progress=False))

    def profile(self, inputs: list[Any]) -> list[dict[str, Any]]:
        """The 25 operators of one run of `inputs` with the most host time, with their device
        time and call counts."""
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(ProfilerActivity.CUDA)
        with profile(activities=activities) as prof:
            self.run(inputs)
            _sync(self.device)
        events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
        return [
            {
                "name": e.key,
                "calls": e.count,
                "self_cpu_ms": e.self_cpu_time_total / 1e3,
                "self_device_ms": getattr(e, "self_device_time_total", 0.0) / 1e3,
            }
            for e in events[:25]
        ]

    def timed(self, inputs: list[Any]) -> tuple[dict[str, Any], np.ndarray]:
        """One round: its seconds, the host CPU seconds, CUDA graph replays and compiles."""
        dynamo, replays = _dynamo(), self.graph_replays()
        _sync(self.device)
        wall, cpu = time.perf_counter(), time.process_time()
        out = self.run(inputs)
        _sync(self.device)
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        after = _dynamo()
        return {
            "seconds": wall,
            "host_cpu_seconds": cpu,
            "graph_replays": self.graph_replays() - replays,
            "compiled_frames": after["frames"] - dynamo["frames"],
            "recompiles": after["recompiles"] - dynamo["recompiles"],
        }, out


def load_inputs(args: argparse.Namespace, folder: Path) -> dict[str, dict[str, list[Any]]]:
    import tokenizers

    tokenizer = tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json"))
    out: dict[str, dict[str, list[Any]]] = {}
    for w in args.workloads:
        texts, ids = make_inputs(tokenizer, workload_lengths(w, args.n))
        out[w] = {"ids": ids, "text": texts}
    return out


def warm(subject: Subject, inputs: dict[str, dict[str, list[Any]]]) -> None:
    """Every workload and form once at full size (compiles, records graphs, fills caches)."""
    for forms in inputs.values():
        for form in FORMS:
            subject.run(forms[form])


def measure_alone(args: argparse.Namespace) -> dict[str, Any]:
    """The `--child` process: one engine, warmed, `--repeats` rounds of everything."""
    folder = args.folder
    inputs = load_inputs(args, folder)
    subject = Subject(args.engines[args.child], folder, args)
    warm(subject, inputs)
    rounds: list[dict[str, Any]] = []
    outputs: dict[str, list[list[float]]] = {}
    for _ in range(args.repeats):
        for w, forms in inputs.items():
            for form in FORMS:
                row, out = subject.timed(forms[form])
                rounds.append({"workload": w, "form": form, **row})
                outputs[f"{w}/{form}"] = out[:8].tolist()
    result: dict[str, Any] = {"rounds": rounds, "outputs": outputs}
    if args.profile:
        result["profile"] = subject.profile(inputs[args.workloads[0]]["text"])
    return result


def alone(args: argparse.Namespace, argv: list[str], index: int, folder: Path) -> dict[str, Any]:
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        command = [
            sys.executable,
            __file__,
            *argv,
            "--child",
            str(index),
            "--folder",
            str(folder),
            "--output",
            out.name,
        ]
        subprocess.run(command, check=True)
        return json.loads(Path(out.name).read_text())


def summarize(rounds: list[dict[str, Any]], tokens: dict[str, int]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key in sorted({(r["workload"], r["form"]) for r in rounds}):
        mine = [r for r in rounds if (r["workload"], r["form"]) == key]
        seconds = [r["seconds"] for r in mine]
        median = statistics.median(seconds)
        out[f"{key[0]}/{key[1]}"] = {
            "seconds": record.rounds(seconds),
            "tokens_per_s": tokens[key[0]] / median,
            "host_cpu_seconds": record.rounds([r["host_cpu_seconds"] for r in mine]),
            "graph_replays": [r["graph_replays"] for r in mine],
            "compiled_frames": [r["compiled_frames"] for r in mine],
            "recompiles": [r["recompiles"] for r in mine],
        }
    return out


def main(argv: list[str]) -> dict[str, Any]:
    args = parse_args(argv)
    if args.shared_code:
        from vecpool.runner import compiled

        compiled.OWN_CODE = False
    if args.child is not None:
        result = measure_alone(args)
        args.output.write_text(json.dumps(result))
        return result
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"--device {args.device}: CUDA is not available here")
    report: dict[str, Any] = {
        **record.header("bench_engines.py", argv, device=args.device, commit=args.commit),
        "shape": args.shape,
        "engines": args.engines,
        "n": args.n,
    }
    tokenizer_dir = args.tokenizer
    if tokenizer_dir is None:
        from vecpool.api.build import default_model_path

        tokenizer_dir = default_model_path()
    with tempfile.TemporaryDirectory() as tmp:
        folder = write_folder(SHAPES[args.shape], Path(tmp), tokenizer_dir, args.device)
        inputs = load_inputs(args, folder)
        tokens = {w: sum(len(i) for i in forms["ids"]) for w, forms in inputs.items()}
        report["tokens"] = tokens
        # Alone first: the subprocesses need the device to themselves.
        solo = [alone(args, argv, i, folder) for i in range(len(args.engines))]
        subjects = []
        for name in args.engines:
            started = time.perf_counter()
            subjects.append(Subject(name, folder, args))
            warm(subjects[-1], inputs)
            print(f"built and warmed {name} in {time.perf_counter() - started:.1f} s", flush=True)
        together: list[list[dict[str, Any]]] = [[] for _ in subjects]
        outputs: list[dict[str, np.ndarray]] = [{} for _ in subjects]
        for _ in range(args.repeats):
            for i, subject in enumerate(subjects):
                for w, forms in inputs.items():
                    for form in FORMS:
                        row, out = subject.timed(forms[form])
                        together[i].append({"workload": w, "form": form, **row})
                        outputs[i][f"{w}/{form}"] = out[:8]
        profiles = (
            [s.profile(inputs[args.workloads[0]]["text"]) for s in subjects] if args.profile else []
        )
        gc.collect()
    report["engines_report"] = []
    worst = 0.0
    for i, name in enumerate(args.engines):
        a, t = summarize(solo[i]["rounds"], tokens), summarize(together[i], tokens)
        ratios = {k: t[k]["tokens_per_s"] / a[k]["tokens_per_s"] for k in a}
        diffs = {
            k: float(np.abs(outputs[i][k] - np.asarray(v)).max())
            for k, v in solo[i]["outputs"].items()
        }
        worst = max(worst, *diffs.values())
        report["engines_report"].append(
            {
                "engine": name,
                "position": i,
                "alone": a,
                "together": t,
                "together_over_alone": ratios,
                "largest_output_difference": diffs,
                **(
                    {"profile_alone": solo[i]["profile"], "profile_together": profiles[i]}
                    if args.profile
                    else {}
                ),
            }
        )
        print(
            f"{i} {name:5} "
            + "  ".join(
                f"{k} {a[k]['tokens_per_s']:,.0f} -> {t[k]['tokens_per_s']:,.0f} ({ratios[k]:.3f}x)"
                for k in a
            ),
            flush=True,
        )
    record.write(args.output, report)
    if worst > args.atol:
        raise SystemExit(
            f"an engine's outputs beside the others differ from its outputs alone by {worst:g} "
            f"(allowed: --atol {args.atol:g})"
        )
    return report


if __name__ == "__main__":
    main(sys.argv[1:])
