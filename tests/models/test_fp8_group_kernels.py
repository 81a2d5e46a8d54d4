"""The Triton kernels that quantize rows per group for block-wise FP8 (vecpool/models/
fp8_kernels.py), run by Triton's interpreter on the CPU against the ops' CPU kernels (the
reference math in torch): the group scales, their layout for cuBLAS, and the padding rows; and
the residual sum the RMSNorm kernels add first (per group and per row): one float32 sum, cast
once, to the bit under the interpreter's cast.

The interpreter's float32 -> FP8 casts are not the device's (they were off by up to half a
value), so the FP8 values themselves are checked on the GPU (benchmarks/lab/fp8_block_check.py).
"""

from __future__ import annotations

import json

import pytest
import torch

# (rows, columns): rows padded to 16 or already a multiple; columns a multiple of the group of
# 128 or not (a last, shorter group); one row.
SHAPES = [(5, 256), (37, 384), (16, 200), (1, 128)]


def run_cases() -> list[dict[str, object]]:
    from vecpool.models.quant import fp8_kernels, fp8_ops

    results: list[dict[str, object]] = []
    sums_equal: dict[str, bool] = {}
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
            "rms_norm_rows": (
                fp8_kernels.rms_norm_rows(x, w, 1e-6, False),
                fp8_ops.rms_norm_rows(x, w, 1e-6, False),
            ),
        }
        residual = x.to(torch.bfloat16)
        delta = torch.randn(rows, cols, generator=gen).to(torch.bfloat16)
        summed = {
            "add_rms_norm": (
                fp8_kernels.add_rms_norm_groups(residual, delta, w, 1e-6, False, 128),
                fp8_ops.add_rms_norm_groups(residual, delta, w, 1e-6, False, 128),
            ),
            "add_rms_norm_rows": (
                fp8_kernels.add_rms_norm_rows(residual, delta, w, 1e-6, True),
                fp8_ops.add_rms_norm_rows(residual, delta, w, 1e-6, True),
            ),
        }
        for name, ((total, *got), (total_ref, *_)) in summed.items():
            assert total.dtype == total_ref.dtype == torch.bfloat16
            # The interpreter casts float32 to bf16 by dropping the low 16 bits; a device
            # rounds to nearest, as torch does (what `total_ref` is).
            exact = (residual.float() + delta.float()).view(torch.int32)
            dropped = (exact & ~0xFFFF).view(torch.float32).to(torch.bfloat16)
            sums_equal[f"{name} {rows}x{cols}"] = torch.equal(total, dropped)
            within = (total.float() - total_ref.float()).abs() <= total_ref.float().abs() / 128
            sums_equal[f"{name} {rows}x{cols} within an ulp"] = bool(within.all())
            # The norm, against the reference's of the kernel's own sum.
            norm = (
                fp8_ops.rms_norm_rows(total, w, 1e-6, True)
                if name.endswith("rows")
                else fp8_ops.rms_norm_groups(total, w, 1e-6, False, 128)
            )
            cases[name] = (tuple(got), norm)
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
    return [*results, {"sums_equal": sums_equal}]


def test_group_scales_layout_and_padding_match_the_reference() -> None:
    """In a process of its own: the interpreter is chosen when Triton is imported."""
    pytest.importorskip("triton", reason="the test extras install Triton")
    from tests.helpers import run_interpreted  # here: this file also runs as that script

    *results, sums = run_interpreted(__file__)
    # The residual sums: one float32 sum of the two, cast once to the residual's bf16.
    assert len(sums["sums_equal"]) == 4 * len(SHAPES)
    assert all(sums["sums_equal"].values()), sums
    assert len(results) == 7 * len(SHAPES)
    for result in results:
        rows_kernel = "_rows " in result["case"]
        case = result["case"]
        assert result["shapes"] == result["shapes_ref"], case
        if rows_kernel:  # one scale a row, no padding: the per-channel layers' form
            assert result["shapes"][1][1] == 1, case
            assert result["scale_max_rel_diff"] <= 1e-6, case
            continue
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
