"""The int8 kernel probe (benchmarks/lab/int8_kernels.py) runs in seconds, natively and in a
process capped to AVX2, and records what decided the engine's kernel: each candidate's error to
float64 and whether FBGEMM sums the full uint8 x int8 range exactly there."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from benchmarks.lab.int8_kernels import SHAPES, main


@pytest.mark.skipif(
    "fbgemm" not in torch.backends.quantized.supported_engines, reason="torch without FBGEMM"
)
def test_int8_kernels_probe_reports_both_instruction_sets(tmp_path: Path) -> None:
    out = tmp_path / "int8_kernels.json"
    report = main(["--rows", "8", "--rounds", "1", "--seconds", "0", "--output", str(out)])
    assert out.exists() and set(report["isa"]) == {"native", "avx2"}
    capped = report["isa"]["avx2"]
    assert capped["caps"]["FBGEMM_ENABLE_INSTRUCTIONS"] == "AVX2"
    # Capped to AVX2 (no VNNI), FBGEMM's 16-bit pair sums saturate on the full range.
    assert capped["fbgemm_full_range_exact"] is False
    for result in report["isa"].values():
        assert set(result["ms_median"]) == set(SHAPES)
        for name in SHAPES:
            errors = result["rel_error"][name]
            assert errors["fp32"] < 1e-5
            # The engine's layer on random rows with eight loud channels (one kept in float32):
            # 8-bit rows about 0.017, 7-bit rows (capped) twice that.
            assert errors["vecpool-int8"] < 0.05
            timings = result["ms_median"][name]["8"]
            assert all(t > 0 for t in timings.values())
