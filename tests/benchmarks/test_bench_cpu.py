"""The CPU benchmark runs in seconds on a handful of inputs, under the CPU's own instruction
set and capped at AVX2, each in a process of its own, its numbers consistent with each other:
medians of the raw timings, each round's ratio from that round's timings, the faster
reference of each round, every round kept with the caps it ran under, and the fidelity of
float32, bfloat16 and int8 against the references."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from benchmarks.bench_cpu import CAPS, SYSTEMS, main


def test_bench_cpu_reports_interleaved_rounds_per_instruction_set(tmp_path: Path) -> None:
    out = tmp_path / "cpu.json"
    # Two rounds: the order of the systems rotates between them. Three passages: the third
    # (264 tokens) is truncated to the model's 256 by both sides.
    report = main(["--queries", "4", "--passages", "3", "--rounds", "2", "--output", str(out)])
    saved = json.loads(out.read_text())
    assert saved["isas"] == report["isas"] and saved["summary"] == report["summary"]
    assert set(report["isas"]) == {"native", "avx2"}
    assert report["isas"]["native"]["caps"] == {}
    assert report["isas"]["avx2"]["caps"] == CAPS["avx2"]
    assert report["isas"]["avx2"]["cpu_capability"] == "AVX2" or not report["isas"]["native"][
        "cpu_capability"
    ].startswith("AVX512")  # capping only lowers an x86-64 CPU with more than AVX2
    # Every round, with the caps it ran under.
    assert [(r["isa"], r["round"]) for r in report["rounds"]] == [
        (isa, n) for isa in ("native", "avx2") for n in (1, 2)
    ]
    for isa, part in report["isas"].items():
        # The engine logged its per-machine choice (one float32 engine, one bfloat16 natively).
        assert part["cpu_choice"] and all("linears " in line for line in part["cpu_choice"])
        systems = set(SYSTEMS) - ({"vecpool-bf16"} if isa == "avx2" else set())
        assert set(part["seconds"]) == {"queries", "passages"}
        for r in (r for r in report["rounds"] if r["isa"] == isa):
            assert r["caps"] == part["caps"]
            for w, by_system in r["seconds"].items():
                assert by_system == {s: part["seconds"][w][s][r["round"] - 1] for s in systems}
        for w, by_system in part["seconds"].items():
            assert set(by_system) == systems
            assert all(len(s) == 2 for s in by_system.values())
            tokens = part["workloads"][w]["num_tokens"]
            rates = part["summary"]["tokens_per_s_median"][w]
            assert rates["st-32"] == tokens / statistics.median(by_system["st-32"])
            ratios = part["summary"]["ratio_median"][w]["vecpool"]
            ours = by_system["vecpool"]
            assert ratios["st-32"] == statistics.median(
                [a / b for a, b in zip(by_system["st-32"], ours, strict=True)]
            )
            best = [min(a, b) for a, b in zip(by_system["st-32"], by_system["st-128"], strict=True)]
            assert ratios["st-best"] == statistics.median(
                [a / b for a, b in zip(best, ours, strict=True)]
            )
            assert report["summary"]["float32_vs_st_best"][isa][w] == ratios["st-best"]
            fidelity = part["fidelity"]
            # float32 against sentence-transformers: the same sums in another order.
            assert fidelity[f"{w}_vecpool_vs_st-32_min_cosine"] > 1 - 1e-5
            assert fidelity[f"{w}_vecpool_vs_st-32_max_abs_diff"] < 1e-4
            if isa == "native":  # bfloat16 (8 bits of mantissa) against float32, six layers
                assert 0.99 < fidelity[f"{w}_vecpool-bf16_vs_vecpool_min_cosine"] < 1
            # int8 against float32: the minimum tests/models/test_int8.py holds it to (its
            # median floor needs more than these few inputs: it is checked there).
            lowest = fidelity[f"{w}_vecpool-int8_vs_vecpool_min_cosine"]
            assert 0.995 <= lowest <= fidelity[f"{w}_vecpool-int8_vs_vecpool_median_cosine"] < 1
    assert report["workloads"]["passages"]["num_tokens"] <= 3 * 256  # truncated as the model
