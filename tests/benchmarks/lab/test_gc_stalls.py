"""The garbage-collection A/B runs in seconds on the CPU: every call of every round timed, the
tokens/s of a round those of its calls, the frozen state's objects kept out of full passes,
and the engine's switch and the collector left as they were."""

from __future__ import annotations

import gc
import statistics
from pathlib import Path

import pytest

from benchmarks.lab.gc_stalls import STATES, main
from vecpool.api import default_model_path, heap


def test_gc_stalls_times_both_states_round_by_round(tmp_path: Path) -> None:
    argv = ["--models", "tiny-bert", "--n", "24", "--calls", "3", "--rounds", "2"]
    argv += ["--tokenizer", str(default_model_path()), "--device", "cpu"]
    callbacks = list(gc.callbacks)
    report = main([*argv, "--output", str(tmp_path / "gc.json")])
    (row,) = report["rows"]
    assert row["num_inputs"] == 24 and row["tracked_objects_when_warm"] > 1000
    for state in STATES:
        rounds = row["rounds"][state]
        assert len(rounds) == 2
        for r in rounds:
            assert len(r["call_seconds"]) == 3 and all(s > 0 for s in r["call_seconds"])
            tokens = 3 * row["num_tokens"]
            assert r["tokens_per_s"] == pytest.approx(tokens / sum(r["call_seconds"]), rel=1e-12)
            assert all(ms >= 0 for ms in r["full_passes_ms"])
        assert row["tokens_per_s"][state] == statistics.median(r["tokens_per_s"] for r in rounds)
        assert row["full_passes_per_round"][state] == [len(r["full_passes_ms"]) for r in rounds]
    ratio = row["tokens_per_s"]["frozen"] / row["tokens_per_s"]["unfrozen"]
    assert row["frozen_over_unfrozen"] == pytest.approx(ratio, rel=1e-12)
    assert heap.FREEZE is True
    assert gc.get_freeze_count() == 0  # the script unfreezes what it froze
    assert gc.callbacks == callbacks
