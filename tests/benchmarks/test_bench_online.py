"""The online benchmark runs anywhere: a tiny model on the CPU, its numbers consistent with
each other, every answer equal to the offline engine's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.bench_online import main


# base64 through every scenario; float (the other answer format) through single-input clients.
@pytest.mark.parametrize(
    ("encoding", "scenarios", "clients"),
    [("base64", ["embed", "batched"], ["4", "16"]), ("float", ["embed"], ["8"])],
)
def test_bench_online_runs_on_cpu_and_reports_consistent_numbers(
    tmp_path: Path, encoding: str, scenarios: list[str], clients: list[str]
) -> None:
    out = tmp_path / "online.json"
    argv = ["--synthetic", "tiny-bert", "--device", "cpu", "--scenarios", *scenarios]
    argv += ["--encoding-format", encoding]
    argv += ["--clients", *clients, "--batched-clients", "2", "--batched-inputs", "64"]
    argv += ["--n", "48", "--repeats", "3", "--client-processes", "1", "--output", str(out)]
    report = main(argv)
    assert json.loads(out.read_text())["rows"] == json.loads(json.dumps(report["rows"]))
    rows = {(r["scenario"], r["clients"]): r for r in report["rows"]}
    expected = {("embed", int(c)) for c in clients}
    expected |= {("batched", 2)} if "batched" in scenarios else set()
    assert set(rows) == expected
    for (scenario, _), row in rows.items():
        assert row["connection_error_count"] == 0 and row["statuses"] == {"200": row["requests"]}
        assert row["requests"] == (48 if scenario == "embed" else 2)
        assert row["requests_per_s"] == row["requests"] / row["seconds"]
        assert row["ratio_to_offline"] == row["tokens_per_s"] / row["offline_tokens_per_s"]
        # The row is the median round by its ratio to offline, next to every round.
        assert len(row["rounds"]) == 3
        ratios = sorted(r["ratio_to_offline"] for r in row["rounds"])
        assert row["ratio_to_offline"] == ratios[1] == row["median"]["ratio_to_offline"]
        assert row["max_abs_diff_vs_offline"] <= 1e-6
        assert row["engine"]["steps"] >= 1 and row["engine"]["inputs_per_step"] >= 1
        # CPU: the server's process tree spent some per request, offline some per input.
        assert row["server_cpu_s_per_request"] > 0 and row["offline_cpu_s_per_item"] > 0
        # ... split by the processes' names: the parts sum to the whole.
        by = row["server_cpu_s_per_request_by_process"]
        assert sum(by.values()) == pytest.approx(row["server_cpu_s_per_request"], rel=1e-9)
        per_request = 1 if scenario == "embed" else 32  # inputs of one request
        assert row["server_cpu_s_per_item"] == row["server_cpu_s_per_request"] / per_request
        assert row["cpu_efficiency"] == row["offline_cpu_s_per_item"] / row["server_cpu_s_per_item"]
        # The clients' own CPU: some per request; one client process, busy at most its
        # round's wall time across its threads (a little slack for the clock's grain).
        cpu = row["client_cpu_s_per_request"] * row["requests"]
        assert cpu > 0 and row["client_cpu_busy"] == pytest.approx(cpu / row["seconds"], rel=1e-9)
        assert row["client_cpu_busy"] <= 1.5
        assert row["queue_drain_ms"] == row["clients"] / row["requests_per_s"] * 1000
        assert row["p99_over_drain"] == row["latency_ms"]["p99"] / row["queue_drain_ms"]
        # The latency split by the server's headers: each part positive, the means adding up
        # to the mean latency (to the float sum's rounding), the engine's part at most the
        # latency it is part of (the headers carry microseconds: rounding slack).
        split = row["latency_split_ms"]
        parts = [split[k]["mean"] for k in ("tokenize", "engine", "rest")]
        assert min(parts) > 0 and sum(parts) == pytest.approx(split["total"]["mean"], rel=1e-9)
        assert split["engine"]["p50"] <= split["total"]["p50"] + 1e-3
    # Over the embed rows' rounds (96 requests, whole clock ticks of CPU) both the API process
    # and the engine process were seen working.
    for role in ("api", "engine"):
        assert (
            sum(rows["embed", int(c)]["server_cpu_s_per_request_by_process"][role] for c in clients)
            > 0
        )
