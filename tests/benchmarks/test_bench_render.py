"""The response-writing benchmark runs in seconds: both writers timed per case, every round
kept with its median, and the two bodies read back as the same values (else it raises)."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.bench_render import CASES, main
from vecpool.server.routes import common


def test_bench_render_times_both_writers_on_every_case(tmp_path: Path) -> None:
    writer = common.dumps
    out = tmp_path / "render.json"
    report = main(["--rounds", "2", "--calls", "2", "--output", str(out)])
    assert json.loads(out.read_text())["rows"] == report["rows"]
    assert [(r["width"], r["vectors"]) for r in report["rows"]] == list(CASES)
    for row in report["rows"]:
        for name in ("msgspec", "json"):
            assert len(row[name]["rounds"]) == 2 and row[name]["median"] > 0
        # The same values, differently spelled (msgspec writes 1e-05 as 0.00001).
        assert row["bytes"]["msgspec"] > 0 and row["bytes"]["json"] > 0
    assert common.dumps is writer  # the module's writer put back
