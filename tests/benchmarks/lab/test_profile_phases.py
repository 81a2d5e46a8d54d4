"""The phase profile runs on the CPU in seconds: per call, the phases and the rest add up to the
wall time, every phase is a time the call spent, and the steps counted are the call's own."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest

from benchmarks.lab.profile_phases import PHASES, main
from benchmarks.workloads import workload_lengths
from vecpool.api import default_model_path


def test_profile_phases_adds_up_each_call(tmp_path: Path) -> None:
    out = tmp_path / "phases.json"
    argv = ["--device", "cpu", "--models", "tiny-bert", "--workloads", "queries", "--n", "48"]
    report = main([*argv, "--tokenizer", str(default_model_path()), "--output", str(out)])
    assert json.loads(out.read_text())["rows"] == report["rows"]
    (row,) = report["rows"]
    assert (row["model"], row["workload"], row["num_inputs"]) == ("tiny-bert", "queries", 48)
    assert row["num_tokens"] == int(workload_lengths("queries", 48).sum())
    assert row["steps_per_call"] >= 1
    assert len(row["calls"]) == 5
    for call in row["calls"]:
        assert all(call[name] >= 0 for name in PHASES)
        assert call["forward (launch)"] > 0 and call["schedule + build"] > 0
        assert call["rest"] >= 0
        assert sum(call[name] for name in (*PHASES, "rest")) == pytest.approx(call["wall"])
    for key in ("wall", *PHASES, "rest"):
        assert row["median_seconds"][key] == statistics.median(c[key] for c in row["calls"])


def test_profile_phases_profiles_one_more_call_each_way(tmp_path: Path) -> None:
    # 600 inputs: a large call, run in chunks (its input worker labelled too).
    argv = ["--device", "cpu", "--models", "tiny-bert", "--workloads", "queries", "--n", "600"]
    extra = ["--cprofile", "5", "--torch-profile", "5", "--gaps", "3"]
    report = main([*argv, *extra, "--tokenizer", str(default_model_path())])
    (row,) = report["rows"]
    assert any("Ordered by: internal time" in line for line in row["cprofile"])
    assert any("Self CPU time total" in line for line in row["torch_profile"])
    gaps = row["device_gaps"]
    # On the CPU nothing runs on a device: the whole call is one idle stretch, from its start.
    assert gaps["num_stretches"] == 1 and gaps["device_idle_ms"] == gaps["call_ms"] > 0
    assert gaps["longest"][0]["at_ms"] == 0 and gaps["longest"][0]["ms"] == gaps["call_ms"]
