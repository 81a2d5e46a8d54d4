"""The CPU serving benchmark runs anywhere: a tiny model, both instruction sets in rounds that
alternate their order, every round kept with its caps, its figures consistent with each other
and the summary read from the rounds' medians."""

from __future__ import annotations

import json
import platform
import statistics
from pathlib import Path

import pytest

from benchmarks.bench_cpu import CAPS
from benchmarks.bench_online_cpu import P99_OVER_DRAIN_TARGET, main


def test_bench_online_cpu_runs_both_instruction_sets_in_interleaved_rounds(
    tmp_path: Path,
) -> None:
    out = tmp_path / "online_cpu.json"
    argv = ["--synthetic", "tiny-bert", "--clients", "1", "3", "--n", "12", "--rounds", "3"]
    report = main([*argv, "--output", str(out)])
    assert json.loads(out.read_text())["rounds"] == json.loads(json.dumps(report["rounds"]))
    assert set(report["isas"]) == {"native", "avx2"}
    assert report["isas"]["native"]["caps"] == {}
    # bench_cpu.py's caps, which hold the three.
    assert report["isas"]["avx2"]["caps"] == CAPS["avx2"]
    assert {
        "ONEDNN_MAX_CPU_ISA": "AVX2",
        "MKL_ENABLE_INSTRUCTIONS": "AVX2",
        "ATEN_CPU_CAPABILITY": "avx2",
    }.items() <= CAPS["avx2"].items()
    if platform.machine() == "x86_64":  # the capped process's torch dispatched to AVX2
        assert report["isas"]["avx2"]["cpu_capability"] == "AVX2"
    for isa in ("native", "avx2"):  # each offline engine logged the CPU choice it made
        assert any("linear" in line for line in report["isas"][isa]["cpu_choice"])
    rounds = report["rounds"]
    # Every round of each instruction set and client count, the order of the instruction
    # sets rotating from round to round.
    order = [(r["round"], r["isa"], r["clients"]) for r in rounds]
    assert order == [
        (1, "native", 1), (1, "native", 3), (1, "avx2", 1), (1, "avx2", 3),
        (2, "avx2", 1), (2, "avx2", 3), (2, "native", 1), (2, "native", 3),
        (3, "native", 1), (3, "native", 3), (3, "avx2", 1), (3, "avx2", 3),
    ]  # fmt: skip
    for row in rounds:
        assert row["caps"] == report["isas"][row["isa"]]["caps"]
        assert row["requests"] == 12 and row["statuses"] == {"200": 12}
        assert row["connection_error_count"] == 0
        assert row["requests_per_s"] == row["requests"] / row["seconds"]
        assert row["queue_drain_ms"] == row["clients"] / row["requests_per_s"] * 1000
        assert row["p99_over_drain"] == row["latency_ms"]["p99"] / row["queue_drain_ms"]
        by = row["server_cpu_ms_per_request_by_process"]
        assert sum(by.values()) == pytest.approx(row["server_cpu_ms_per_request"], rel=1e-9)
        assert row["offline_cpu_ms_per_input"] > 0 and row["offline_inputs_per_s"] > 0
        assert row["engine"]["steps"] >= 1 and 1 <= row["engine"]["inputs_per_step"] <= 3
    # The summary's targets come from each figure's median over the rounds.
    for isa, target in report["summary"]["targets"].items():
        few, many = ([r for r in rounds if r["isa"] == isa and r["clients"] == c] for c in (1, 3))
        p99_over_drain = statistics.median(r["p99_over_drain"] for r in many)
        assert target["p99_over_drain"] == p99_over_drain
        assert target["p99_over_drain_met"] == (p99_over_drain <= P99_OVER_DRAIN_TARGET)
        ratio = statistics.median(r["requests_per_s"] for r in many) / statistics.median(
            r["requests_per_s"] for r in few
        )
        assert target["requests_per_s_many_over_few"] == pytest.approx(ratio, rel=1e-12)
        assert target["throughput_met"] == (ratio >= 1.0)
