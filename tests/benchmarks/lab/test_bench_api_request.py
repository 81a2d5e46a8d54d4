"""The API-request benchmark runs in seconds on the CPU: both paths of the app timed in
interleaved rounds, every request answered 200 (else it raises), each figure's rounds kept with
their median, and the ratio taken round by round."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest

from benchmarks.lab.bench_api_request import main


def test_bench_api_request_times_both_paths_round_by_round(tmp_path: Path) -> None:
    out = tmp_path / "api.json"
    argv = ["--n", "48", "--clients", "8", "--rounds", "3", "--dim", "16", "--output", str(out)]
    report = main(argv)
    assert json.loads(out.read_text()) == json.loads(json.dumps(report))
    assert set(report["paths"]) == {"fast", "fastapi"}
    cpu = {}
    for path, figures in report["paths"].items():
        for name in ("loop_cpu_us_per_request", "requests_per_s"):
            rounds = figures[name]["rounds"]
            assert len(rounds) == 3 and min(rounds) > 0
            assert figures[name]["median"] == statistics.median(rounds)
        cpu[path] = figures["loop_cpu_us_per_request"]["rounds"]
    ratios = [slow / fast for fast, slow in zip(cpu["fast"], cpu["fastapi"], strict=True)]
    assert report["cpu_ratio_fastapi_to_fast"]["rounds"] == pytest.approx(ratios, rel=1e-12)


def test_bench_api_request_runs_one_path_alone(tmp_path: Path) -> None:
    report = main(["--n", "16", "--clients", "4", "--rounds", "1", "--paths", "fast"])
    assert set(report["paths"]) == {"fast"} and "cpu_ratio_fastapi_to_fast" not in report
