"""The CPU benchmark runs in seconds on a handful of inputs, its numbers consistent with each
other: medians of the raw timings, each round's ratio from that round's timings, the faster
reference of each round, and the fidelity of float32 and bfloat16 against the references."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from benchmarks.bench_cpu import SYSTEMS, main


def test_bench_cpu_reports_interleaved_rounds(tmp_path: Path) -> None:
    out = tmp_path / "cpu.json"
    report = main(["--queries", "6", "--passages", "3", "--rounds", "3", "--output", str(out)])
    saved = json.loads(out.read_text())
    assert saved["seconds"] == report["seconds"] and saved["summary"] == report["summary"]
    assert set(report["seconds"]) == {"queries", "passages"}
    for w, by_system in report["seconds"].items():
        assert set(by_system) == set(SYSTEMS)
        assert all(len(s) == 3 for s in by_system.values())
        tokens = report["workloads"][w]["num_tokens"]
        rates = report["summary"]["tokens_per_s_median"][w]
        assert rates["st-32"] == tokens / statistics.median(by_system["st-32"])
        ratios = report["summary"]["ratio_median"][w]["vecpool"]
        ours = by_system["vecpool"]
        assert ratios["st-32"] == statistics.median(
            [a / b for a, b in zip(by_system["st-32"], ours, strict=True)]
        )
        best = [min(a, b) for a, b in zip(by_system["st-32"], by_system["st-128"], strict=True)]
        assert ratios["st-best"] == statistics.median(
            [a / b for a, b in zip(best, ours, strict=True)]
        )
        fidelity = report["fidelity"]
        # float32 against sentence-transformers: the same sums in another order.
        assert fidelity[f"{w}_vecpool_vs_st-32_min_cosine"] > 1 - 1e-5
        assert fidelity[f"{w}_vecpool_vs_st-32_max_abs_diff"] < 1e-4
        # bfloat16 (8 bits of mantissa) against float32, on a six-layer model.
        assert 0.99 < fidelity[f"{w}_vecpool-bf16_vs_vecpool_min_cosine"] < 1
    assert report["workloads"]["passages"]["num_tokens"] <= 3 * 256  # truncated as the model
