"""How every benchmark records its results: a header that says how the numbers were taken, and
each figure as every round's raw value next to their median.

    report = {**record.header("bench_x.py", argv, device=args.device, commit=args.commit), ...}
    report["seconds"] = record.rounds([run() for _ in range(args.repeats)])
    record.write(args.output, report)

The header: the commit (`git rev-parse HEAD`, or `--commit` where a copy of the tree carries a
stale or no .git), the UTC date, the versions of python, torch, transformers and
sentence-transformers, the device (GPU name, driver and CUDA version; or the CPU model and its
core count) and the load average, and the command line with no machine paths (a path inside the
repository relative to it, any other by its last part).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import shlex
import statistics
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
MIN_ROUNDS = 3  # the default number of timed rounds of every benchmark
PACKAGES = ("torch", "transformers", "sentence-transformers", "tokenizers", "numpy")


def add_args(parser: argparse.ArgumentParser) -> None:
    """The recorder's option: `--commit`, for a tree whose .git is stale or absent."""
    parser.add_argument(
        "--commit",
        help="the commit measured, recorded as given (default: `git rev-parse HEAD`)",
    )


def git_commit(root: Path = REPO) -> str | None:
    """`git rev-parse HEAD` of the repository at `root`, or None where there is no git."""
    try:
        return subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def portable_arg(arg: str, root: Path = REPO) -> str:
    """`arg` with any absolute path in it (alone, or after `--flag=`) made relative to the
    repository when inside it, else cut to its last part."""
    flag, eq, value = arg.partition("=") if arg.startswith("-") else ("", "", arg)
    if not os.path.isabs(value):
        return arg
    path = Path(value)
    try:
        short = str(path.resolve().relative_to(root.resolve()))
    except ValueError:
        short = path.name
    return f"{flag}{eq}{short}"


def command_line(script: str, argv: Sequence[str], root: Path = REPO) -> str:
    """`python benchmarks/SCRIPT ARGS` with no machine paths in it."""
    return shlex.join(["python", f"benchmarks/{script}", *(portable_arg(a, root) for a in argv)])


def versions() -> dict[str, str | None]:
    """Python's version and the installed versions of the packages a benchmark compares."""
    out: dict[str, str | None] = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return out


def cpu_model() -> str:
    """The CPU's model name (from /proc/cpuinfo where there is one)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def gpu_driver() -> str | None:
    """The NVIDIA driver's version, from nvidia-smi (None where there is none)."""
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            check=True,
            timeout=30,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return out.splitlines()[0].strip() if out.strip() else None


def device_info(device: str | None) -> dict[str, Any]:
    """What ran the benchmark: the GPU of `device` (a CUDA device) with its driver and CUDA
    version, and always the CPU model, its core count and the torch threads."""
    import torch

    out: dict[str, Any] = {
        "name": cpu_model(),
        "cpu_model": cpu_model(),
        "cpu_cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
    }
    if device is not None and str(device).startswith("cuda") and torch.cuda.is_available():
        out["name"] = torch.cuda.get_device_name(torch.device(device))
        out["gpu_count"] = torch.cuda.device_count()
        out["cuda"] = torch.version.cuda
        out["driver"] = gpu_driver()
    return out


def header(
    script: str, argv: Sequence[str], *, device: str | None, commit: str | None = None
) -> dict[str, Any]:
    """How a run was taken: commit, UTC date, command line, versions, device, load average."""
    return {
        "commit": commit or git_commit(),
        "commit_from": "--commit" if commit else "git rev-parse HEAD",
        "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "command": command_line(script, argv),
        "versions": versions(),
        "device": device_info(device),
        "load_average_at_start": list(os.getloadavg()),
    }


def rounds(values: Sequence[float]) -> dict[str, Any]:
    """A figure measured in rounds: every round's value and their median."""
    if not values:
        raise ValueError("a figure needs at least one round")
    return {"rounds": [float(v) for v in values], "median": float(statistics.median(values))}


def median_of_rounds(per_round: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The median of each number the rounds' dicts share (nested dicts key by key); other
    values are kept where every round agrees on them."""
    if not per_round:
        raise ValueError("no rounds")
    out: dict[str, Any] = {}
    for key, first in per_round[0].items():
        values = [r.get(key) for r in per_round]
        numbers = [v for v in values if isinstance(v, int | float) and not isinstance(v, bool)]
        dicts = [v for v in values if isinstance(v, dict)]
        if len(numbers) == len(values):
            out[key] = float(statistics.median(numbers))
        elif len(dicts) == len(values):
            out[key] = median_of_rounds(dicts)
        elif all(v == first for v in values):
            out[key] = first
    return out


def median_round(per_round: Sequence[dict[str, Any]], key: str) -> dict[str, Any]:
    """The round whose `key` is the median of the rounds' (the lower middle one of an even
    count: never the better of two), for figures that must come from one round."""
    if not per_round:
        raise ValueError("no rounds")
    ordered = sorted(per_round, key=lambda r: r[key])
    return ordered[(len(ordered) - 1) // 2]


def write(path: Path | None, report: dict[str, Any]) -> None:
    """The report as indented JSON at `path` (its folder made), if a path is given."""
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1) + "\n")
