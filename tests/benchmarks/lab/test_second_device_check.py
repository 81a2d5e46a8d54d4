"""The two-device check runs anywhere as a check of the script: two engines on the CPU, the
same prompts from this thread, another thread and `AsyncEngine`, equal bit for bit."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.lab.second_device_check import main


def test_second_device_check_runs_on_cpu(tmp_path: Path) -> None:
    out = tmp_path / "second.json"
    argv = ["--devices", "cpu", "cpu", "--no-compile", "--archs", "bert", "--output", str(out)]
    assert main(argv) == 0
    [row] = json.loads(out.read_text())["rows"]
    assert row["arch"] == "bert" and row["ok"] is True
    for key in ("this_thread_max_abs", "other_thread_max_abs", "async_engine_max_abs"):
        assert row[key] == 0.0
    assert row["second_graph_replays"] > 0 and row["largest_abs"] > 0
