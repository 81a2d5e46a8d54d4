"""The host-side benchmark runs in seconds on a few inputs, its figures consistent with each
other: every round kept with its median, the Python share is that round's text time less its
fast tokenizer's time, and the tokens counted are the workload's, clipped to the model's limit."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import numpy as np
import pytest

from benchmarks.lab.bench_prepare import FIGURES, LOSSES, PAIR_FIGURES, main
from benchmarks.workloads import workload_lengths


def test_bench_prepare_reports_rounds_per_figure(tmp_path: Path) -> None:
    out = tmp_path / "prepare.json"
    readme = Path(__file__).resolve().parents[3] / "README.md"
    argv = ["--n", "40", "--rounds", "3", "--spin-alone", "0.02", "--output", str(out)]
    argv += ["--corpus", str(readme), "--pairs"]
    report = main(argv)
    assert json.loads(out.read_text())["workloads"] == report["workloads"]
    assert report["unit"] == "microseconds per input"
    limit = report["max_model_len"]
    assert limit == 256  # the packaged all-MiniLM-L6-v2's
    assert list(report["workloads"]) == ["queries", "passages", "prose", "pairs"]
    pairs = report["workloads"]["pairs"]
    assert pairs["num_inputs"] == 40
    # A query's and a passage's own tokens (a workload's lengths count two special tokens),
    # with the pair's three, cut to the limit where over it.
    own = workload_lengths("queries", 40) + np.minimum(workload_lengths("passages", 40), limit)
    assert pairs["num_tokens"] == int(np.minimum(own - 4 + 3, limit).sum())
    for name in PAIR_FIGURES:
        assert len(pairs[name]["rounds"]) == 3 and pairs[name]["median"] > 0
    for w in ("queries", "passages", "prose"):
        result = report["workloads"][w]
        assert result["num_inputs"] == 40
        if w != "prose":
            assert result["num_tokens"] == int(np.minimum(workload_lengths(w, 40), limit).sum())
        for name in FIGURES + LOSSES:
            rounds = result[name]["rounds"]
            assert len(rounds) == 3
            assert result[name]["median"] == statistics.median(rounds)
        for text, tok, python in zip(
            result["text"]["rounds"],
            result["tokenizer_fast"]["rounds"],
            result["text_python"]["rounds"],
            strict=True,
        ):
            assert python == pytest.approx(text - tok)
        # Every figure is a time: positive (a difference of two may not be).
        assert all(result[k]["median"] > 0 for k in FIGURES if k != "text_python")
