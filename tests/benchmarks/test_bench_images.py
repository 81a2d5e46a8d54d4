"""The images benchmark's vision-language part (ColQwen2's token vectors, GME's one vector per
input) runs in seconds on tiny shapes, its numbers consistent with each other: rates from the raw
timings, each round's ratio from that round's timings, and float32 vectors equal to
transformers' (the same arithmetic in other kernel shapes)."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest

from benchmarks.bench_images import main


@pytest.mark.parametrize("shape", ["colqwen2-tiny", "gme-tiny"])
def test_bench_vlm_reports_pages_and_queries(shape: str, tmp_path: Path) -> None:
    out = tmp_path / f"{shape}.json"
    argv = ["--device", "cpu", "--models", shape, "--images", "3", "--queries", "4"]
    argv += ["--size", "120x90", "--rounds", "2", "--vlm-batch-size", "2", "--output", str(out)]
    report = main(argv)
    assert json.loads(out.read_text())["results"] == report["results"]
    (result,) = report["results"]
    assert (result["shape"], result["num_pages"], result["num_queries"]) == (shape, 3, 4)
    for work, count in (("pages", 3), ("queries", 4)):
        figures = result[work]
        seconds = figures["seconds"]
        assert set(seconds) == {"vecpool", "transformers"}
        assert all(len(s) == 2 for s in seconds.values())
        for system, timings in seconds.items():
            rates = figures["per_s"][system]
            assert rates["median"] == statistics.median(count / s for s in timings)
        assert figures["ratio_median"] == statistics.median(
            a / b for a, b in zip(seconds["transformers"], seconds["vecpool"], strict=True)
        )
        if shape == "gme-tiny":
            assert figures["vectors"] == count  # one per input: its last row
        else:
            assert figures["vectors"] > count  # one per token
        # float32 on the CPU: unit vectors equal to transformers' within rounding.
        assert figures["cosine_to_transformers"]["min"] > 1 - 1e-5
