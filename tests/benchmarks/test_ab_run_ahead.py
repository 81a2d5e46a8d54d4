"""The run-ahead A/B runs in seconds on the CPU: both orders timed every round, their outputs
identical, the ratio that of the medians."""

from __future__ import annotations

import statistics
from pathlib import Path

import pytest

from benchmarks.ab_run_ahead import main
from vecpool.api import default_model_path


def test_ab_run_ahead_reports_both_orders(tmp_path: Path) -> None:
    argv = ["--models", "tiny-bert", "--workloads", "queries", "--n", "24", "--rounds", "2"]
    argv += ["--tokenizer", str(default_model_path()), "--device", "cpu"]
    report = main([*argv, "--output", str(tmp_path / "ab.json")])
    (row,) = report["rows"]
    assert row["num_inputs"] == 24 and row["identical"]
    medians = {}
    for order in ("run-ahead", "in order"):
        seconds = row[order]["seconds"]
        assert len(seconds) == 2 and all(s > 0 for s in seconds)
        medians[order] = statistics.median(seconds)
        assert row[order]["tokens_per_s"] == row["num_tokens"] / medians[order]
    assert row["ratio"] == pytest.approx(medians["in order"] / medians["run-ahead"], rel=1e-12)
