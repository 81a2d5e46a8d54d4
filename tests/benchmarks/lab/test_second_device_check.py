"""The two-device check runs anywhere as a check of the script: two engines on the CPU, the
same prompts from this thread, another thread and `AsyncEngine`, equal bit for bit."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.lab import second_device_check
from benchmarks.lab.second_device_check import main

# The script's kinds of prompts, fewer and shorter: single tokens to a few hundred, and packs
# of short ones. The CPU runs them as padded bf16 attention, whose cost grows with the number
# of prompts times the longest one squared (the script's 89 prompts up to 500 tokens took
# most of a minute).
LENGTHS = [1, 3, 9, 17, 30, 64, 100, 257, *[12] * 4, *[40] * 4]


def test_second_device_check_runs_on_cpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(second_device_check, "LENGTHS", LENGTHS)
    out = tmp_path / "second.json"
    argv = ["--devices", "cpu", "cpu", "--no-compile", "--archs", "bert", "--output", str(out)]
    assert main(argv) == 0
    [row] = json.loads(out.read_text())["rows"]
    assert row["arch"] == "bert" and row["ok"] is True
    for key in ("this_thread_max_abs", "other_thread_max_abs", "async_engine_max_abs"):
        assert row[key] == 0.0
    assert row["second_graph_replays"] > 0 and row["largest_abs"] > 0
