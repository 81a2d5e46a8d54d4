"""The GPU benchmark runs anywhere: tiny shapes on the CPU, in seconds, with the numbers it
reports consistent with each other and with the reference systems."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from benchmarks.bench_gpu import FlopModel, main
from benchmarks.workloads import workload_lengths


def test_workloads_follow_their_distributions() -> None:
    queries = workload_lengths("queries", 4096)
    passages = workload_lengths("passages", 4096)
    assert queries.min() == 8 and queries.max() == 64
    assert 34 <= queries.mean() <= 38
    assert passages.min() == 32 and passages.max() == 512
    assert 170 <= np.median(passages) <= 190  # lognormal around ln 180
    assert np.array_equal(queries, workload_lengths("queries", 4096))  # fixed seed


def test_flops_count_causal_and_bidirectional_attention() -> None:
    lengths = np.array([3, 5])
    causal = FlopModel(non_embedding_params=10, attention_width=4, num_layers=2, causal=True)
    full = FlopModel(non_embedding_params=10, attention_width=4, num_layers=2, causal=False)
    assert causal.flops(lengths) == 2 * 10 * 8 + 4 * 4 * 2 * (6 + 15)
    assert full.flops(lengths) == 2 * 10 * 8 + 4 * 4 * 2 * (9 + 25)


def test_bench_runs_on_cpu_and_reports_consistent_numbers(tmp_path: Path) -> None:
    out = tmp_path / "report.json"
    systems = ["vecpool-text", "vecpool-ids", "st-32", "hf-padded"]
    argv = ["--models", "tiny-qwen3", "--n", "12", "--repeats", "2", "--warmup", "4"]
    argv += ["--device", "cpu", "--fidelity", "4", "--output", str(out), "--systems", *systems]
    report = main(argv)
    assert json.loads(out.read_text())["rows"] == json.loads(json.dumps(report["rows"]))
    assert report["ceiling_flops"] > 1e8
    rows = {(r["workload"], r["system"]): r for r in report["rows"]}
    assert "error" not in str(report["rows"])
    assert set(rows) == {(w, s) for w in ("queries", "passages") for s in systems}
    for (workload, _), row in rows.items():
        assert row["num_tokens"] == int(workload_lengths(workload, 12).sum())
        assert len(row["seconds"]) == 2
        assert row["median_seconds"] == np.median(row["seconds"])
        assert row["tokens_per_s"] == row["num_tokens"] / row["median_seconds"]
        assert row["mfu"] > 0
    # MFU is the model's FLOPs over a workload's time over the ceiling: the same FLOPs for every
    # system of a workload. (Not below 1 as such: on the CPU a tiny model's step can outrun the
    # measured ceiling's large product, and both are timings.)
    for workload in ("queries", "passages"):
        flops = {s: rows[workload, s]["mfu"] * rows[workload, s]["median_seconds"] for s in systems}
        flops = {s: f * report["ceiling_flops"] for s, f in flops.items()}
        assert all(f == pytest.approx(flops[systems[0]], rel=1e-9) for f in flops.values())
    fidelity = report["fidelity"]["tiny-qwen3"]
    for w in ("queries", "passages"):
        assert fidelity[f"{w}_text_vs_ids_max_abs"] == 0.0
        assert fidelity[f"{w}_vs_st-32_min_cosine"] > 0.9999
        assert fidelity[f"{w}_vs_hf-padded_min_cosine"] > 0.9999
        assert fidelity[f"{w}_vs_fp32_min_cosine"] > 0.9999


def test_bench_reports_the_http_path_next_to_offline(tmp_path: Path) -> None:
    out = tmp_path / "report.json"
    argv = ["--models", "tiny-bert", "--workloads", "passages", "--systems", "vecpool-text"]
    argv += ["--n", "64", "--repeats", "2", "--warmup", "4", "--device", "cpu", "--fidelity", "0"]
    argv += ["--http", "--http-clients", "2", "--http-client-processes", "1", "--http-repeats", "3"]
    report = main([*argv, "--output", str(out)])
    assert json.loads(out.read_text())["http"] == json.loads(json.dumps(report["http"]))
    (offline,) = report["rows"]
    (http,) = report["http"]
    assert http["model"] == "tiny-bert" and http["clients"] == 2
    assert http["inputs_per_request"] == 32 and http["requests"] == 2  # 64 passages
    assert http["connection_error_count"] == 0 and http["statuses"] == {"200": 2}
    # The served tokens are the offline workload's, and the ratio is of the two rates.
    assert http["tokens_per_s"] * http["seconds"] == pytest.approx(offline["num_tokens"])
    assert http["ratio_to_offline"] == http["tokens_per_s"] / http["offline_tokens_per_s"]
    assert len(http["rounds"]) == 3
    assert 0 < http["latency_ms"]["p50"] <= http["latency_ms"]["p99"]
    assert http["max_abs_diff_vs_offline"] <= 1e-6
