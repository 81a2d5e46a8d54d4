"""The benchmarks' recorder writes how a run was taken and every round next to their median,
and every results file of the repository says when, at which commit and how it was taken."""

from __future__ import annotations

import json
import re
import statistics
import subprocess
from pathlib import Path

import pytest

from benchmarks import record

RESULTS = Path(record.__file__).parent / "results"


def test_header_says_how_the_run_was_taken(tmp_path: Path) -> None:
    output = record.REPO / "benchmarks" / "results" / "x.json"
    argv = ["--n", "3", "--output", str(output), f"--tokenizer={tmp_path / 'tok'}", "/abs/dir"]
    head = record.header("bench_x.py", argv, device="cpu", commit="abc123")
    assert head["commit"] == "abc123" and head["commit_from"] == "--commit"
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", head["date_utc"])
    # No machine path: inside the repository relative to it, elsewhere the last part only.
    assert head["command"] == (
        "python benchmarks/bench_x.py --n 3 --output benchmarks/results/x.json --tokenizer=tok dir"
    )
    versions = head["versions"]
    assert set(versions) >= {"python", "torch", "transformers", "sentence-transformers"}
    import torch
    import transformers

    assert versions["torch"] == torch.__version__
    assert versions["transformers"] == transformers.__version__
    device = head["device"]
    assert device["cpu_cores"] >= 1 and device["name"] == device["cpu_model"] != ""
    assert "driver" not in device  # a CPU run has no GPU driver to name
    assert len(head["load_average_at_start"]) == 3


def test_header_reads_the_commit_from_git_without_an_override() -> None:
    head = record.header("bench_x.py", [], device=None)
    expected = subprocess.run(
        ["git", "rev-parse", "HEAD"], cwd=record.REPO, capture_output=True, text=True
    ).stdout.strip()
    assert head["commit"] == (expected or None)
    assert head["commit_from"] == "git rev-parse HEAD"


def test_rounds_keep_every_value_and_their_median() -> None:
    assert record.rounds([3.0, 1.0, 2.0]) == {"rounds": [3.0, 1.0, 2.0], "median": 2.0}
    assert record.rounds([4, 1, 3, 2])["median"] == 2.5
    with pytest.raises(ValueError):
        record.rounds([])


def test_median_round_and_median_of_rounds() -> None:
    rounds = [
        {"ratio": 0.9, "rate": 10.0, "lat": {"p99": 5.0}, "name": "a", "ok": True},
        {"ratio": 0.5, "rate": 30.0, "lat": {"p99": 1.0}, "name": "a", "ok": True},
        {"ratio": 0.7, "rate": 20.0, "lat": {"p99": 9.0}, "name": "a", "ok": False},
    ]
    assert record.median_round(rounds, "ratio") is rounds[2]
    # Of two rounds the lower one: never the better of two.
    assert record.median_round(rounds[:2], "ratio") is rounds[1]
    medians = record.median_of_rounds(rounds)
    assert medians == {"ratio": 0.7, "rate": 20.0, "lat": {"p99": 5.0}, "name": "a"}


def test_write_makes_the_folder_and_round_trips(tmp_path: Path) -> None:
    report = {"command": "python benchmarks/x.py", "seconds": record.rounds([1.0, 2.0, 3.0])}
    path = tmp_path / "a" / "b.json"
    record.write(path, report)
    assert json.loads(path.read_text()) == report
    record.write(None, report)  # no output asked: nothing written, no error


@pytest.mark.parametrize("path", sorted(RESULTS.glob("*.json")), ids=lambda p: p.name)
def test_every_results_file_says_when_and_how_it_was_taken(path: Path) -> None:
    report = json.loads(path.read_text())
    assert report.get("commit"), f"{path.name}: no commit"
    assert report.get("date_utc") or report.get("date"), f"{path.name}: no date"
    if report.get("recorded_from_git"):
        # Filled in afterwards from the commit that added the numbers: a full hash and its date.
        assert re.fullmatch(r"[0-9a-f]{40}", report["commit"]), path.name
        assert report["recorded_from_git_note"], path.name
    else:
        command = str(report.get("command", ""))
        assert re.search(r"(^|\s)python3? benchmarks/(lab/)?\w+\.py", command), path.name
    text = path.read_text()
    for machine in ("/root/", "/home/", "/work/", "/tmp/", "/opt/"):
        assert machine not in text, f"{path.name}: a machine path ({machine})"


def test_medians_of_the_recorded_rounds_are_their_medians() -> None:
    """Where a results file keeps a figure's rounds and its median, the median is theirs."""
    checked = 0
    for path in sorted(RESULTS.glob("*.json")):
        rows = json.loads(path.read_text()).get("rows", [])
        for row in rows if isinstance(rows, list) else []:  # (a count in some files)
            if isinstance(row, dict) and "seconds" in row and "median_seconds" in row:
                assert row["median_seconds"] == pytest.approx(statistics.median(row["seconds"]))
                checked += 1
    assert checked > 0
