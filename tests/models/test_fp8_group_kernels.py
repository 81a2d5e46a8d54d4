"""The Triton kernels that quantize rows per group for block-wise FP8 (vecpool/models/
fp8_kernels.py), run by Triton's interpreter on the CPU against the ops' CPU kernels (the
reference math in torch): the group scales, their layout for cuBLAS, and the padding rows.

The interpreter's float32 -> FP8 casts are not the device's (they were off by up to half a
value), so the FP8 values themselves are checked on the GPU (benchmarks/fp8_block_check.py).
"""

from __future__ import annotations

import json

import pytest
import torch

# (rows, columns): rows padded to 16 or already a multiple; columns a multiple of the group of
# 128 or not (a last, shorter group); one row.
SHAPES = [(5, 256), (37, 384), (16, 200), (1, 128)]


def run_cases() -> list[dict[str, object]]:
    from vecpool.models import fp8_kernels, fp8_ops

    results: list[dict[str, object]] = []
    for i, (rows, cols) in enumerate(SHAPES):
        gen = torch.Generator().manual_seed(i)
        x = torch.randn(rows, cols, generator=gen) * torch.rand(rows, 1, generator=gen) * 10
        x[0] = 0.0  # an all-zero row
        w = torch.randn(cols, generator=gen)
        gate_up = torch.randn(rows, 2 * cols, generator=gen)
        cases = {
            "quant": (fp8_kernels.quant_groups(x, 128), fp8_ops.quant_groups(x, 128)),
            "rms_norm": (
                fp8_kernels.rms_norm_groups(x, w, 1e-6, False, 128),
                fp8_ops.rms_norm_groups(x, w, 1e-6, False, 128),
            ),
            "rms_norm_unit_offset": (
                fp8_kernels.rms_norm_groups(x, w, 1e-6, True, 128),
                fp8_ops.rms_norm_groups(x, w, 1e-6, True, 128),
            ),
            "silu_mul": (
                fp8_kernels.silu_mul_groups(gate_up, 128),
                fp8_ops.silu_mul_groups(gate_up, 128),
            ),
        }
        for name, ((q, scale), (q_ref, scale_ref)) in cases.items():
            results.append(
                {
                    "case": f"{name} {rows}x{cols}",
                    "shapes": [list(q.shape), list(scale.shape)],
                    "shapes_ref": [list(q_ref.shape), list(scale_ref.shape)],
                    "scale_strides": list(scale.stride()),
                    "scale_strides_ref": list(scale_ref.stride()),
                    "scale_max_rel_diff": float(((scale - scale_ref).abs() / scale_ref).max()),
                    "padding_zero": bool((q[rows:].float() == 0).all()),
                }
            )
    return results


def test_group_scales_layout_and_padding_match_the_reference() -> None:
    """In a process of its own: the interpreter is chosen when Triton is imported."""
    pytest.importorskip("triton", reason="the test extras install Triton")
    from tests.helpers import run_interpreted  # here: this file also runs as that script

    results = run_interpreted(__file__)
    assert len(results) == 4 * len(SHAPES)
    for result in results:
        case = result["case"]
        assert result["shapes"] == result["shapes_ref"], case
        assert result["shapes"][0][0] % 16 == 0, case  # rows padded for cuBLAS
        # Each group's scales side by side for all rows ((1, rows) strides), as cuBLAS reads
        # (the second stride means nothing with one group).
        assert result["scale_strides"][0] == result["scale_strides_ref"][0] == 1, case
        if result["shapes"][1][1] > 1:
            assert result["scale_strides"][1] == result["scale_strides_ref"][1], case
        # The same amax of the same float32 values; the norm's sum in another order.
        assert result["scale_max_rel_diff"] <= 1e-6, case
        assert result["padding_zero"], case


if __name__ == "__main__":
    print(json.dumps(run_cases()))
