"""The engine-loop benchmark runs in seconds on the CPU: every call answered with a vector
(the client process checks), steps no larger than asked, its figures consistent."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.lab.bench_engine_loop import main
from vecpool.api import default_model_path


def test_bench_engine_loop_reports_per_request_and_per_step(tmp_path: Path) -> None:
    out = tmp_path / "loop.json"
    argv = ["--n", "120", "--rounds", "2", "--clients", "8", "--max-num-seqs", "4"]
    report = main([*argv, "--tokenizer", str(default_model_path()), "--output", str(out)])
    assert json.loads(out.read_text())["cpu_us_per_request"] == report["cpu_us_per_request"]
    assert report["clients"] == 8 and report["max_num_seqs"] == 4
    for i in range(2):
        per_request = report["cpu_us_per_request"]["rounds"][i]
        per_step = report["cpu_us_per_step"]["rounds"][i]
        inputs = report["inputs_per_step"]["rounds"][i]
        assert 1 <= inputs <= 4  # the steps hold at most --max-num-seqs
        assert per_request > 0 and per_step == pytest.approx(per_request * inputs, rel=1e-9)
        assert 0 < report["busy"]["rounds"][i] <= 1.05


def test_bench_engine_loop_against_a_revision_alternates_both_loops(tmp_path: Path) -> None:
    argv = ["--n", "60", "--rounds", "2", "--clients", "4", "--max-num-seqs", "4"]
    report = main([*argv, "--tokenizer", str(default_model_path()), "--against", "HEAD"])
    against = report["against"]
    assert against["revision"] == "HEAD"
    assert len(against["cpu_us_per_request"]["rounds"]) == 2
    assert len(report["cpu_us_per_request"]["rounds"]) == 2
    assert report["cpu_per_request_ratio"] == pytest.approx(
        report["cpu_us_per_request"]["median"] / against["cpu_us_per_request"]["median"]
    )
    for i in range(2):
        assert 1 <= against["inputs_per_step"]["rounds"][i] <= 4
