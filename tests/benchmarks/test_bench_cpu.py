"""The CPU benchmark runs in seconds on a handful of inputs, its numbers consistent with each
other: medians of the raw timings, each round's ratio from that round's timings."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from benchmarks.bench_cpu import main


def test_bench_cpu_reports_interleaved_rounds(tmp_path: Path) -> None:
    out = tmp_path / "cpu.json"
    report = main(["--queries", "6", "--passages", "3", "--rounds", "3", "--output", str(out)])
    saved = json.loads(out.read_text())
    assert saved["seconds"] == report["seconds"] and saved["summary"] == report["summary"]
    assert set(report["seconds"]) == {"queries", "passages"}
    for w, by_system in report["seconds"].items():
        assert set(by_system) == {"vecpool", "st-32", "st-128"}
        assert all(len(s) == 3 for s in by_system.values())
        tokens = report["workloads"][w]["num_tokens"]
        rates = report["summary"]["tokens_per_s_median"][w]
        assert rates["st-32"] == tokens / statistics.median(by_system["st-32"])
        ratios = [a / b for a, b in zip(by_system["st-32"], by_system["vecpool"], strict=True)]
        assert report["summary"]["ratio_median"][w]["st-32"] == statistics.median(ratios)
        assert report["fidelity"][f"{w}_vs_st-32_min_cosine"] > 0.99999
    assert report["workloads"]["passages"]["num_tokens"] <= 3 * 256  # truncated as the model
