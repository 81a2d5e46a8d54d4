"""The reliability figures are read from what the reliability tests print: every figure
parsed from a sample of their output, and a missing line refused by name."""

from __future__ import annotations

import pytest

from benchmarks.lab.reliability_figures import parse


def test_reliability_figures_reads_what_the_tests_print() -> None:
    printed = (
        "429 latency p50 0.58 ms, p99 8.48 ms\n"
        ".admitted 32, refused 88, longest wait 0.4375 s\n"
        "/health during the flood: 2 probes, longest 0.7 ms\n"
        ".rss per round (MB): [498.6, 498.9, 499.0, 499.0, 499.0, 499.0, 499.0, 499.2]\n"
        "traced per round (MB): [0.2, 0.2, 0.2, 0.2, 0.2, 0.3, 0.3, 0.3]\n"
        "rss per round (MB): [499.2, 506.1, 515.5, 524.9, 534.3, 543.7, 553.0, 562.4]\n"
        "traced per round (MB): [9.6, 19.0, 28.4, 37.8, 47.2, 56.5, 65.9, 75.3]\n"
        "1000 slow clients opened in 0.40 s, closed at 2.01-2.38 s; a request meanwhile took 312 ms\n"
    )
    figures = parse(printed)
    assert figures["refusal_ms"] == {"p50": 0.58, "p99": 8.48}
    assert (figures["admitted"], figures["refused"], figures["longest_wait_s"]) == (32, 88, 0.4375)
    assert figures["health_longest_ms"] == 0.7
    assert figures["memory"]["rss_growth_from_round_3_mb"] == 0.2
    assert figures["memory"]["traced_growth_from_round_3_mb"] == 0.1
    assert figures["memory_leaking"]["traced_growth_from_round_3_mb"] == 46.9
    assert figures["slow_clients_closed_s"] == [2.01, 2.38]
    assert figures["request_meanwhile_ms"] == 312.0
    with pytest.raises(RuntimeError, match="429 latency"):
        parse(printed.replace("429 latency", "refusal"))
