"""The host-cost benchmark runs in seconds: every round kept with its median, the tokens
counted are the workload's, and the stub forward leaves the engine's answers well-formed."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import numpy as np

from benchmarks.lab.bench_host import HIDDEN, main, stub_engine
from benchmarks.workloads import workload_lengths
from vecpool.api import default_model_path


def test_bench_host_reports_rounds_per_form(tmp_path: Path) -> None:
    out = tmp_path / "host.json"
    report = main(["--n", "24", "--rounds", "2", "--workloads", "queries", "--output", str(out)])
    assert json.loads(out.read_text())["workloads"] == report["workloads"]
    result = report["workloads"]["queries"]
    assert result["num_inputs"] == 24
    assert result["num_tokens"] == int(workload_lengths("queries", 24).sum())
    for form in ("ids", "text"):
        rounds = result[form]["rounds"]
        assert len(rounds) == 2 and all(r > 0 for r in rounds)
        assert result[form]["median"] == statistics.median(rounds)


def test_the_stub_engine_pools_its_zeros() -> None:
    engine = stub_engine(default_model_path())
    vectors = engine.embed(["a b c", [101, 2000, 102]], normalize=False)
    assert vectors.shape == (2, HIDDEN)
    assert np.array_equal(vectors, np.zeros((2, HIDDEN), dtype=np.float32))
