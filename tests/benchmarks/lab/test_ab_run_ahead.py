"""The step-pipeline A/B runs in seconds on the CPU: both variants timed every round, their
outputs identical, the ratio that of the medians, and the engine left as it was."""

from __future__ import annotations

import statistics
from pathlib import Path

import pytest

import vecpool.api.build
from benchmarks.lab.ab_run_ahead import GQA_TILE, LABELS, POW2_UP_TO, UPLOAD, main
from vecpool.api import default_model_path
from vecpool.models.layers import basic as layers
from vecpool.models.layers import packed_attention
from vecpool.runner import batch, graphs
from vecpool.runner.graphs import token_buckets


@pytest.mark.parametrize("against", sorted(LABELS))
def test_ab_run_ahead_reports_both_variants(
    tmp_path: Path, against: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    decoder = against in ("unfused-rotary", "sum-outside-norm")  # its norms, rotary, FP8 stack
    model = "tiny-qwen3" if decoder else "tiny-bert"
    argv = ["--models", model, "--workloads", "queries", "--n", "24", "--rounds", "2"]
    argv += ["--tokenizer", str(default_model_path()), "--device", "cpu", "--against", against]
    if against == "sum-outside-norm":
        # FP8 as the CPU emulates it (`benchmarks/lab/fp8_emulate.py`)
        monkeypatch.setattr(vecpool.api.build, "check_quantization", lambda m, d: None)
        argv += ["--quantization", "fp8"]
    report = main([*argv, "--output", str(tmp_path / "ab.json")])
    (row,) = report["rows"]
    assert row["num_inputs"] == 24
    # The buckets pad a step's rows to another count: its products may round otherwise.
    assert row["identical"] or (against == "pow2-buckets" and row["max_abs_diff"] < 1e-5)
    new, old = LABELS[against]
    medians = {}
    for label in (new, old):
        seconds = row[label]["seconds"]
        assert len(seconds) == 2 and all(s > 0 for s in seconds)
        medians[label] = statistics.median(seconds)
        assert row[label]["tokens_per_s"] == row["num_tokens"] / medians[label]
    assert row["ratio"] == pytest.approx(medians[old] / medians[new], rel=1e-12)
    # The switches the variants flip are left as the engine has them.
    assert batch.upload is UPLOAD
    assert layers.COMPILED_ATEN_GELU and layers.COMPILED_RESIDUAL_IN_PLACE
    assert packed_attention.GQA_TILE == GQA_TILE and graphs.NARROW_WIDTH == 1024


def test_pow2_buckets_are_the_old_rule() -> None:
    old = token_buckets(2048, fine_from=POW2_UP_TO)
    assert old == [16, 32, 64, 128, 256, 512, 1024, 1280, 1536, 1792, 2048]
    assert token_buckets(2048)[:5] == [16, 32, 64, 128, 160]
