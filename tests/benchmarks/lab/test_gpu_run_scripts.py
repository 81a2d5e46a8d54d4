"""The GPU run scripts still run: `pending_gpu_runs.sh`'s steps with SMOKE=1 (tiny models
on the CPU) write the results files they name, and an unknown group is refused."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from vecpool.api import default_model_path

ROOT = Path(__file__).resolve().parents[3]


def _run(tmp_path: Path, *groups: str) -> subprocess.CompletedProcess[str]:
    env = {
        **os.environ,
        "SMOKE": "1",
        "OUT": str(tmp_path),
        "PYTHON": sys.executable,
        "TOKENIZER": str(default_model_path()),
        "COMMIT": "0" * 40,
    }
    return subprocess.run(
        ["bash", "benchmarks/lab/pending_gpu_runs.sh", *groups],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_pending_gpu_runs_smoke_writes_each_steps_results(tmp_path: Path) -> None:
    done = _run(tmp_path, "fp8", "host")
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "== fp8: needs CUDA, left out" in done.stdout
    for name in ("gc_stalls_smoke", "ab_first_chunk_smoke"):
        report = json.loads((tmp_path / f"{name}.json").read_text())
        assert report["commit"] == "0" * 40
        assert (tmp_path / f"{name}.log").stat().st_size > 0


def test_pending_gpu_runs_refuses_an_unknown_group(tmp_path: Path) -> None:
    done = _run(tmp_path, "host", "fp16")
    assert done.returncode == 2
    assert "unknown group: fp16" in done.stderr
    assert not list(tmp_path.iterdir())  # checked before anything ran
