"""The engine-loop benchmark runs in seconds on the CPU: every call answered with a vector
(the client process checks), steps no larger than asked, its figures consistent."""

from __future__ import annotations

import json
import multiprocessing as mp
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from benchmarks.lab import bench_engine_loop
from benchmarks.lab.bench_engine_loop import main
from vecpool.api import default_model_path


@pytest.fixture(scope="module", autouse=True)
def _clients_forked_from_a_loaded_server() -> Iterator[None]:
    """The benchmark's client processes (one a round, spawned: each imports the benchmark's
    modules anew, seconds of imports) forked instead from a forkserver that imported them
    once. What runs in them, and what is timed (the engine loop's thread in this process),
    is the same."""
    context = mp.get_context("forkserver")
    context.set_forkserver_preload(["benchmarks.lab.bench_engine_loop"])

    class Forked:  # the benchmark's `multiprocessing`, whose every context is that one
        def get_context(self, method: str | None = None) -> Any:
            return context

        def __getattr__(self, name: str) -> Any:
            return getattr(mp, name)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(bench_engine_loop, "mp", Forked())
        yield


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
