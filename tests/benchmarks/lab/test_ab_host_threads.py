"""The host-thread A/B runs in seconds on the CPU: each value timed every round (the model
stubbed, a simulated device, or a tiny model), outputs identical across values, the ratio that
of the medians, and the varied setting put back."""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path
from typing import Any

import pytest

import vecpool.api.running
import vecpool.inputs.tokenizer
from benchmarks.lab import ab_host_threads
from benchmarks.lab.ab_host_threads import _simulated_device, main
from vecpool.api import default_model_path


@pytest.mark.parametrize(
    ("vary", "values", "extra"),
    [
        ("ahead", ["1", "2"], ["--simulate-device", "400000"]),
        ("first-alone", ["1", "0"], ["--simulate-device", "400000"]),
        ("wordpiece", ["0", "1"], ["--simulate-device", "400000"]),
        ("first-chunk", ["128", "16"], ["--simulate-device", "400000", "--simulate-launch", "2"]),
        ("switch-interval", ["0.005", "0.001"], ["--models", "tiny-bert", "--device", "cpu"]),
    ],
)
def test_ab_host_threads_times_each_value_and_puts_the_setting_back(
    tmp_path: Path, vary: str, values: list[str], extra: list[str]
) -> None:
    ahead, interval = vecpool.api.running.PIPELINE_AHEAD, sys.getswitchinterval()
    first_alone = vecpool.api.running.PIPELINE_FIRST_ALONE
    wordpiece = vecpool.inputs.tokenizer.WORDPIECE_MIN_CHARS
    first_chunk = vecpool.api.running.PIPELINE_FIRST_CHUNK
    argv = ["--vary", vary, "--values", *values, "--tokenizer", str(default_model_path())]
    argv += ["--workloads", "queries", "--n", "40", "--rounds", "2", *extra]
    report = main([*argv, "--output", str(tmp_path / "ab.json")])
    assert len(report["rows"]) == 2  # text and ids
    for row in report["rows"]:
        assert row["num_inputs"] == 40 and row["vary"] == vary
        base = row["values"][f"{float(values[0]):g}"]["seconds"]
        for value in values:
            figures = row["values"][f"{float(value):g}"]
            assert len(figures["seconds"]) == 2 and min(figures["seconds"]) > 0
            assert figures["max_abs_diff"] == 0.0  # the same outputs, whatever the value
            median = statistics.median(figures["seconds"])
            assert figures["tokens_per_s"] == row["num_tokens"] / median
            assert figures["ratio"] == pytest.approx(statistics.median(base) / median)
    assert ahead == vecpool.api.running.PIPELINE_AHEAD and sys.getswitchinterval() == interval
    assert first_alone == vecpool.api.running.PIPELINE_FIRST_ALONE
    assert wordpiece == vecpool.inputs.tokenizer.WORDPIECE_MIN_CHARS
    assert first_chunk == vecpool.api.running.PIPELINE_FIRST_CHUNK


class StepClock:
    """`time` as the simulated device reads it, its `perf_counter` a clock that moves by
    `STEP` at each read: how long the host was held is how many reads it made."""

    STEP = 1e-3

    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        self.now += self.STEP
        return self.now

    def __getattr__(self, name: str) -> Any:
        return getattr(time, name)


def test_a_simulated_launch_holds_the_host_for_its_time(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = StepClock()
    monkeypatch.setattr(ab_host_threads, "time", clock)
    engine = _simulated_device(default_model_path(), rate=1e9, launch=0.05)
    out = engine.embed([[5, 6, 7], [8, 9]], show_progress=False)
    # One step, one launch: the host read the clock until 0.05 s of it had passed, and little
    # more (the step's other reads: its start, the device's time, the pool's wait).
    assert 0.05 <= clock.now <= 0.05 + 5 * clock.STEP
    assert out.shape == (2, 32)
