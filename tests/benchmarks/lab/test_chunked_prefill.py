"""The chunked-prefill benchmark runs anywhere: tiny sizes on the CPU, in seconds, with its
numbers consistent with each other."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.lab.chunked_prefill import main


def test_chunked_prefill_bench_runs_on_cpu(tmp_path: Path) -> None:
    out = tmp_path / "report.json"
    report = main(["--tiny", "--device", "cpu", "--num-queries", "60", "--output", str(out)])
    assert (
        json.loads(out.read_text())["stream"]["configs"].keys()
        == report["stream"]["configs"].keys()
    )
    assert "attention_error" not in report and "stream_error" not in report
    rows = report["attention"]
    assert {(r["kv_heads"], r["window"]) for r in rows} == {
        (kv, w) for kv in ("gqa", "gqa_expanded", "mha") for w in (None, 8)
    }
    for row in rows:
        # float32 on the CPU: the padded fallback against the dense reference, to rounding;
        # a mask aligned to the start of the keys instead is far off (the control).
        assert row["max_abs_err_vs_dense"] <= 1e-5
        assert row["max_abs_err_vs_top_left_control"] >= 0.1
    stream = report["stream"]
    configs = stream["configs"]
    assert set(configs) == {"chunked", "alone", "raised"}
    for name, result in configs.items():
        assert not result["errors"], name
        assert result["long_tokens_per_s"] > 0 and result["num_queries_during_longs"] >= 1
        assert result["query_latency_p50_s"] <= result["query_latency_p99_s"]
        assert result["query_latency_p99_s"] <= result["query_latency_max_s"]
    # Two prompts of 512 tokens: in 128-token chunks (at least 4 steps each), or whole.
    assert configs["chunked"]["steps"] >= 8 > configs["raised"]["steps"]
    assert (
        configs["chunked"]["max_cached_tokens"] == 512
        and configs["alone"]["max_cached_tokens"] == 0
    )
    assert stream["chunked_vs_whole_min_cosine"] >= 0.99999  # float32
    assert stream["cache_after"] == {"entries": 0, "bytes": 0, "pooling_states": 0}
