"""The quantization formats and their reference math, under every quantized layer and kernel.

Rows are quantized one float32 scale each (`quantize_rows`: FP8 for CUDA, int8 weights for the
CPU), or one per row and group of inputs (`quantize_groups`, for weights stored in FP8 blocks):
the scale is the amax over the row (or group) divided by the format's largest value. The CPU's
int8 linears take their input rows in uint8 with a scale and an offset each (`quantize_rows_u8`). The custom ops of
`fp8_ops` compute this math in torch; the Triton kernels of `fp8_kernels` compute the same in
one pass. Nothing here imports another module of the package.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # torch.finfo(float8_e4m3fn).max
INT8_MAX = 127.0
INT8_RANGE = 255.0  # steps of a uint8 row between its least and largest value
# The amax of an all-zero row is raised to this, so its scale is not zero.
MIN_AMAX = 1e-12
# The row count of a cuBLAS block-scaled product is padded to a multiple of this (it needs 4).
ROW_ALIGN = 16


class QuantizedRows(NamedTuple):
    """Rows quantized one scale each (or one per group of inputs): `data * scale` is the row."""

    data: torch.Tensor  # [M, K] float8_e4m3fn or int8
    scale: torch.Tensor  # [M, 1] float32, or [M, ceil(K / group)] for groups


def cdiv(a: int, b: int) -> int:
    """`a / b` rounded up."""
    return -(-a // b)


def quantize_rows(
    x: torch.Tensor, dtype: torch.dtype = FP8_DTYPE, limit: float | None = None
) -> QuantizedRows:
    """`[M, K]` rows -> one float32 scale per row (amax / `limit`, by default the largest value
    of `dtype`) and the rows divided by it and cast (FP8: clamped to +-448; int8: rounded to
    nearest). The reference the FP8 kernels follow, and the int8 weights."""
    if limit is None:
        limit = INT8_MAX if dtype == torch.int8 else FP8_MAX
    x32 = x.float()
    # The largest magnitude of each row, in one pass (no |x| copy).
    amax = torch.linalg.vector_norm(x32, ord=float("inf"), dim=-1, keepdim=True)
    scale = amax.clamp_(min=MIN_AMAX) / limit  # [M, 1]
    scaled = x32 / scale
    if dtype == torch.int8:  # |scaled| <= limit (+ an ulp) already: rounding keeps it in range
        return QuantizedRows(scaled.round_().to(dtype), scale)
    # FP8 has no infinity: a value past 448 by more than half a step would become NaN.
    return QuantizedRows(scaled.clamp_(-limit, limit).to(dtype), scale)


def dequantize_rows(rows: QuantizedRows) -> torch.Tensor:
    """The float32 rows `rows` stands for."""
    return rows.data.float() * rows.scale


class OffsetRows(NamedTuple):
    """Rows quantized one scale and one offset each: `data * scale + offset` is the row."""

    data: torch.Tensor  # [M, K] uint8, or float32 holding the same integers
    scale: torch.Tensor  # [M, 1] float32
    offset: torch.Tensor  # [M, 1] float32: the row's least value


def quantize_rows_u8(
    x: torch.Tensor, as_float: bool = False, levels: float = INT8_RANGE, rounded: bool = True
) -> OffsetRows:
    """`[M, K]` rows -> each row's least value `low`, its range over `levels` (255, or 127 for
    7-bit rows) as the scale, and `(x - low) / scale` rounded to nearest (ties to even):
    integers in [0, levels], as uint8 or, with `as_float`, as float32 (what FBGEMM takes). A row
    of one value has scale `MIN_AMAX / levels` and all zeros. `rounded=False` (with
    `as_float`) leaves the rounding to the kernel that takes the rows (FBGEMM rounds alike)."""
    x32 = x.float()
    # amax and amin apart: two vectorized passes, several times faster than torch.aminmax's one
    low = x32.amin(dim=-1, keepdim=True)
    scale = (x32.amax(dim=-1, keepdim=True) - low).clamp_(min=MIN_AMAX) / levels  # [M, 1]
    inverse = scale.reciprocal()
    # (x - low) / scale: within [0, levels] up to an ulp, which rounding keeps. Two plain
    # passes are faster on the CPU than one addcmul whose operands broadcast ([M, 1]).
    scaled = (x32 - low).mul_(inverse)
    if rounded or not as_float:
        scaled = scaled.round_()
    return OffsetRows(scaled if as_float else scaled.to(torch.uint8), scale, low)


def dequantize_rows_u8(rows: OffsetRows) -> torch.Tensor:
    """The float32 rows `rows` stands for."""
    return rows.data.float() * rows.scale + rows.offset


def quantize_groups(x: torch.Tensor, group: int) -> QuantizedRows:
    """`[M, K]` rows -> FP8 values and one float32 scale per row and group of `group` inputs
    (`[M, ceil(K / group)]`, the group's amax / 448); a last, shorter group scales alone."""
    m, k = x.shape
    pad = cdiv(k, group) * group - k
    x32 = (F.pad(x.float(), (0, pad)) if pad else x.float()).view(m, -1, group)  # [M, G, group]
    amax = torch.linalg.vector_norm(x32, ord=float("inf"), dim=-1, keepdim=True)
    scale = amax.clamp_(min=MIN_AMAX) / FP8_MAX  # [M, G, 1]
    data = (x32 / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).view(m, -1)[:, :k]
    return QuantizedRows(data, scale.view(m, -1))


def dequantize_groups(rows: QuantizedRows, group: int) -> torch.Tensor:
    """The float32 `[M, K]` rows that group-quantized `rows` stand for."""
    m, k = rows.data.shape
    if k % group == 0:  # each group times its scale, without spreading the scales out
        return (rows.data.float().view(m, -1, group) * rows.scale.unsqueeze(-1)).view(m, k)
    return rows.data.float() * rows.scale.repeat_interleave(group, 1)[:, :k]


def bias_and_input_scale(
    out_features: int, bias: bool, out_dtype: torch.dtype, input_scale_shape: tuple[int, ...] | None
) -> tuple[nn.Parameter | None, nn.Parameter | None]:
    """An FP8 linear's optional parameters, unfilled: its bias (`[N]` in `out_dtype`) and a
    checkpoint's static input scale (float32, of the stored shape)."""
    return (
        nn.Parameter(torch.empty(out_features, dtype=out_dtype), requires_grad=False)
        if bias
        else None,
        nn.Parameter(torch.empty(input_scale_shape, dtype=torch.float32), requires_grad=False)
        if input_scale_shape is not None
        else None,
    )
