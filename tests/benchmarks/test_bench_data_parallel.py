"""The data-parallel benchmark runs anywhere: a tiny model on the CPU, serve and embed at one
and two engine processes, every passage answered, the ratios consistent with the rows."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.bench_data_parallel import main


def test_bench_data_parallel_runs_on_cpu(tmp_path: Path) -> None:
    out = tmp_path / "dp.json"
    argv = ["--synthetic", "tiny-bert", "--device", "cpu", "--sizes", "1", "2"]
    argv += ["--passages", "96", "--clients", "2", "--chunk-size", "32", "--repeats", "1"]
    argv += ["--client-processes", "1", "--output", str(out)]
    report = main(argv)
    assert json.loads(out.read_text()) == json.loads(json.dumps(report))
    for mode in ("serve", "embed"):
        rows = report[mode]
        assert set(rows) == {"1", "2"}
        for row in rows.values():
            assert row["tokens_per_s"] > 0
        assert report["ratio"][mode] == {
            "1": 1.0,
            "2": rows["2"]["tokens_per_s"] / rows["1"]["tokens_per_s"],
        }
    for size in ("1", "2"):
        serve = report["serve"][size]
        assert serve["statuses"] == {"200": 3} and serve["connection_error_count"] == 0
    # Both engines of the group answered passages: the round's tokens, between them.
    serve = report["serve"]["2"]
    by_engine = serve["answered_tokens_by_engine"]
    assert set(by_engine) == {"0", "1"} and min(by_engine.values()) > 0
    assert abs(sum(by_engine.values()) - serve["tokens_per_s"] * serve["seconds"]) < 1e-3
    assert report["embed"]["1"]["tokens"] == report["embed"]["2"]["tokens"]
    # Each serve round kept the engine's admission figures as polled, and no refusal.
    for size in ("1", "2"):
        assert "samples" in report["serve"][size]["admission"]
        assert report["serve"][size]["refusals"] == []
