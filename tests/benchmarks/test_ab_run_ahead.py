"""The step-pipeline A/B runs in seconds on the CPU: both variants timed every round, their
outputs identical, the ratio that of the medians, and the engine left as it was."""

from __future__ import annotations

import statistics
from pathlib import Path

import pytest

from benchmarks.ab_run_ahead import LABELS, UPLOAD, main
from vecpool.api import default_model_path
from vecpool.runner import batch


@pytest.mark.parametrize("against", sorted(LABELS))
def test_ab_run_ahead_reports_both_variants(tmp_path: Path, against: str) -> None:
    argv = ["--models", "tiny-bert", "--workloads", "queries", "--n", "24", "--rounds", "2"]
    argv += ["--tokenizer", str(default_model_path()), "--device", "cpu", "--against", against]
    report = main([*argv, "--output", str(tmp_path / "ab.json")])
    (row,) = report["rows"]
    assert row["num_inputs"] == 24 and row["identical"]
    new, old = LABELS[against]
    medians = {}
    for label in (new, old):
        seconds = row[label]["seconds"]
        assert len(seconds) == 2 and all(s > 0 for s in seconds)
        medians[label] = statistics.median(seconds)
        assert row[label]["tokens_per_s"] == row["num_tokens"] / medians[label]
    assert row["ratio"] == pytest.approx(medians[old] / medians[new], rel=1e-12)
    assert batch.upload is UPLOAD
