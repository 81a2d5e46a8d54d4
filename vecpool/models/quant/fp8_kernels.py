# mypy: disable-error-code="no-untyped-def"
"""Triton kernels that emit FP8 rows with their per-row scales, in one pass over the input.

A matmul through `torch._scaled_mm` takes FP8 rows and one float32 scale per row. Quantizing
the rows in separate kernels (amax, divide, cast) costs as much as the FP8 matmul saves; here
each row is read once, its amax reduced in registers, and the FP8 values and the scale written
straight away. Two kernels also compute the row first: an RMSNorm (the input of q/k/v and of
gate/up in a pre-norm decoder) and SiLU(gate) * up (the input of down); the RMSNorm can add
the layer's residual sum first, writing the sum too (`decoder.SumInNormLayer`), so that no
separate kernel writes the sum for the norm to read it back. Each has a variant with one
scale per group of inputs (block-wise FP8 weights): it writes the rows padded to a multiple of
16 (zeros) and the scales of a group side by side for all rows.

Imported only on CUDA, when the model runs FP8 (`vecpool.models.quant.linear`): this module imports
Triton at the top. Each kernel is the CUDA kernel of one of `fp8_ops`'s custom ops, whose CPU
kernel is the same math in torch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vecpool.models.quant import fp8_ops
from vecpool.models.quant.quantize import FP8_DTYPE, FP8_MAX, MIN_AMAX

# Kernels read module constants only as constexprs.
_FP8_MAX = tl.constexpr(FP8_MAX)
_MIN_AMAX = tl.constexpr(MIN_AMAX)


@triton.jit
def _store_fp8_row(y, mask, cols, q_row_ptr, scale_ptr):
    """Quantize one float32 row `y` by its amax: FP8 values to `q_row_ptr`, scale to `scale_ptr`."""
    amax = tl.max(tl.where(mask, tl.abs(y), 0.0), axis=0)
    scale = tl.maximum(amax, _MIN_AMAX) / _FP8_MAX
    q = tl.clamp(y / scale, -_FP8_MAX, _FP8_MAX)
    tl.store(q_row_ptr + cols, q.to(tl.float8e4nv), mask=mask)
    tl.store(scale_ptr, scale)


@triton.jit
def _quant_rows_kernel(x_ptr, q_ptr, s_ptr, n_cols, stride_x, stride_q, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    y = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    _store_fp8_row(y, mask, cols, q_ptr + row * stride_q, s_ptr + row)


@triton.jit
def _load_sum(x_ptr, d_ptr, sum_ptr, row, cols, mask, stride, HAS_DELTA: tl.constexpr):
    """Row `row` of x, or with HAS_DELTA of x + d, rounded to x's dtype (as torch's sum is)
    and stored at `sum_ptr` (stride `stride` too); in float32."""
    x = tl.load(x_ptr + row * stride + cols, mask=mask, other=0.0)
    if HAS_DELTA:
        d = tl.load(d_ptr + row * stride + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + d.to(tl.float32)).to(x.dtype)  # to nearest, even on ties
        tl.store(sum_ptr + row * stride + cols, x, mask=mask)
    return x.to(tl.float32)


@triton.jit
def _rms_norm_quant_kernel(
    x_ptr,
    d_ptr,
    sum_ptr,
    w_ptr,
    q_ptr,
    s_ptr,
    n_cols,
    stride_x,
    stride_q,
    eps,
    UNIT_OFFSET: tl.constexpr,
    HAS_DELTA: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = _load_sum(x_ptr, d_ptr, sum_ptr, row, cols, mask, stride_x, HAS_DELTA)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if UNIT_OFFSET:
        w = w + 1.0
    inv_rms = tl.rsqrt(tl.sum(x * x, axis=0) / n_cols + eps)
    _store_fp8_row(x * inv_rms * w, mask, cols, q_ptr + row * stride_q, s_ptr + row)


@triton.jit
def _silu_mul_quant_kernel(gu_ptr, q_ptr, s_ptr, n_cols, stride_gu, stride_q, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    gate = tl.load(gu_ptr + row * stride_gu + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gu_ptr + row * stride_gu + n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    _store_fp8_row(gate * tl.sigmoid(gate) * up, mask, cols, q_ptr + row * stride_q, s_ptr + row)


def _launch_config(n_cols: int) -> tuple[int, int]:
    block = triton.next_power_of_2(n_cols)
    return block, min(16, max(1, block // 512))


def _outputs(rows: int, cols: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    q = torch.empty((rows, cols), dtype=FP8_DTYPE, device=like.device)  # [M, K]
    scale = torch.empty((rows, 1), dtype=torch.float32, device=like.device)  # [M, 1]
    return q, scale


@fp8_ops.quant_rows.register_kernel("cuda")
def quant_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    x = x if x.stride(-1) == 1 else x.contiguous()
    rows, cols = x.shape
    q, scale = _outputs(rows, cols, x)
    if rows:
        block, warps = _launch_config(cols)
        _quant_rows_kernel[(rows,)](
            x, q, scale, cols, x.stride(0), q.stride(0), BLOCK=block, num_warps=warps
        )
    return q, scale


@fp8_ops.rms_norm_rows.register_kernel("cuda")
def rms_norm_rows(
    x: torch.Tensor, weight: torch.Tensor, eps: float, unit_offset: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    return _rms_norm_rows(x, None, weight, eps, unit_offset)[1:]


@fp8_ops.add_rms_norm_rows.register_kernel("cuda")
def add_rms_norm_rows(
    residual: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float, unit_offset: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _rms_norm_rows(residual, delta, weight, eps, unit_offset)


def _rms_norm_rows(
    x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float, unit_offset: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x + delta, or x with no delta; FP8 rows of its RMSNorm; their scales)."""
    x, delta, total = _with_delta(x, delta)
    rows, cols = x.shape
    q, scale = _outputs(rows, cols, x)
    if rows:
        block, warps = _launch_config(cols)
        _rms_norm_quant_kernel[(rows,)](
            x, delta, total, weight, q, scale, cols, x.stride(0), q.stride(0), eps,
            UNIT_OFFSET=unit_offset, HAS_DELTA=total is not x, BLOCK=block, num_warps=warps,
        )  # fmt: skip
    return total, q, scale


def _with_delta(
    x: torch.Tensor, delta: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x, delta, the sum's output) with rows of unit stride and, with a delta, one row stride
    for the three; without one, x stands in for both (the kernel reads neither)."""
    if delta is None:
        x = x if x.stride(-1) == 1 else x.contiguous()
        return x, x, x
    x = x.contiguous()
    return x, delta.contiguous(), torch.empty_like(x)


@fp8_ops.silu_mul_rows.register_kernel("cuda")
def silu_mul_rows(gate_up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    gate_up = gate_up if gate_up.stride(-1) == 1 else gate_up.contiguous()
    rows, cols = gate_up.shape[0], gate_up.shape[1] // 2
    q, scale = _outputs(rows, cols, gate_up)
    if rows:
        block, warps = _launch_config(cols)
        _silu_mul_quant_kernel[(rows,)](
            gate_up, q, scale, cols, gate_up.stride(0), q.stride(0), BLOCK=block, num_warps=warps
        )
    return q, scale


# ---- one scale per row and group (block-wise FP8 weights) --------------------------------------


@triton.jit
def _store_fp8_groups(
    y, cols, n_cols, q_row_ptr, s_row_ptr, stride_s, BLOCK: tl.constexpr, GROUP: tl.constexpr
):
    """Quantize one float32 row `y` (zero past `n_cols`) by the amax of each group of GROUP:
    FP8 values to `q_row_ptr`, the row's scale of group g to `s_row_ptr + g * stride_s`."""
    groups = tl.reshape(y, (BLOCK // GROUP, GROUP))
    amax = tl.max(tl.abs(groups), axis=1)
    scale = tl.maximum(amax, _MIN_AMAX) / _FP8_MAX
    q = tl.reshape(tl.clamp(groups / scale[:, None], -_FP8_MAX, _FP8_MAX), (BLOCK,))
    tl.store(q_row_ptr + cols, q.to(tl.float8e4nv), mask=cols < n_cols)
    g = tl.arange(0, BLOCK // GROUP)
    tl.store(s_row_ptr + g * stride_s, scale, mask=g * GROUP < n_cols)


@triton.jit
def _group_row(n_rows):
    """This program's row, the input row it reads (a padded row, past `n_rows`, reads the last
    one), and 1.0, or 0.0 for a padded row, which is written as zeros."""
    row = tl.program_id(0).to(tl.int64)
    return row, tl.minimum(row, n_rows - 1), (row < n_rows).to(tl.float32)


@triton.jit
def _quant_groups_kernel(
    x_ptr,
    q_ptr,
    s_ptr,
    n_rows,
    n_cols,
    stride_x,
    stride_q,
    stride_s,
    BLOCK: tl.constexpr,
    GROUP: tl.constexpr,
):
    row, src, valid = _group_row(n_rows)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    y = tl.load(x_ptr + src * stride_x + cols, mask=mask, other=0.0).to(tl.float32) * valid
    _store_fp8_groups(y, cols, n_cols, q_ptr + row * stride_q, s_ptr + row, stride_s, BLOCK, GROUP)


@triton.jit
def _rms_norm_groups_kernel(
    x_ptr,
    d_ptr,
    sum_ptr,
    w_ptr,
    q_ptr,
    s_ptr,
    n_rows,
    n_cols,
    stride_x,
    stride_q,
    stride_s,
    eps,
    UNIT_OFFSET: tl.constexpr,
    HAS_DELTA: tl.constexpr,
    BLOCK: tl.constexpr,
    GROUP: tl.constexpr,
):
    row, src, valid = _group_row(n_rows)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    # A padded row reads (and writes) the last row's sum again: the same values.
    x = _load_sum(x_ptr, d_ptr, sum_ptr, src, cols, mask, stride_x, HAS_DELTA) * valid
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if UNIT_OFFSET:
        w = w + 1.0
    inv_rms = tl.rsqrt(tl.sum(x * x, axis=0) / n_cols + eps)
    y = tl.where(mask, x * inv_rms * w, 0.0)
    _store_fp8_groups(y, cols, n_cols, q_ptr + row * stride_q, s_ptr + row, stride_s, BLOCK, GROUP)


@triton.jit
def _silu_mul_groups_kernel(
    gu_ptr,
    q_ptr,
    s_ptr,
    n_rows,
    n_cols,
    stride_gu,
    stride_q,
    stride_s,
    BLOCK: tl.constexpr,
    GROUP: tl.constexpr,
):
    row, src, valid = _group_row(n_rows)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    gate = tl.load(gu_ptr + src * stride_gu + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gu_ptr + src * stride_gu + n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    y = gate * tl.sigmoid(gate) * up * valid
    _store_fp8_groups(y, cols, n_cols, q_ptr + row * stride_q, s_ptr + row, stride_s, BLOCK, GROUP)


def _group_outputs(
    rows: int, cols: int, group: int, like: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    """(FP8 rows `[Mp, K]`, scales `[Mp, G]` with strides (1, Mp), BLOCK, warps)."""
    padded = fp8_ops.padded_rows(rows)
    q = torch.empty((padded, cols), dtype=FP8_DTYPE, device=like.device)
    groups = -(-cols // group)
    scale = torch.empty((groups, padded), dtype=torch.float32, device=like.device).t()
    block, warps = _launch_config(cols)
    return q, scale, max(block, triton.next_power_of_2(group)), warps


@fp8_ops.quant_groups.register_kernel("cuda")
def quant_groups(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    x = x if x.stride(-1) == 1 else x.contiguous()
    rows, cols = x.shape
    q, scale, block, warps = _group_outputs(rows, cols, group, x)
    if q.shape[0]:
        _quant_groups_kernel[(q.shape[0],)](
            x, q, scale, rows, cols, x.stride(0), q.stride(0), scale.stride(1),
            BLOCK=block, GROUP=group, num_warps=warps,
        )  # fmt: skip
    return q, scale


@fp8_ops.rms_norm_groups.register_kernel("cuda")
def rms_norm_groups(
    x: torch.Tensor, weight: torch.Tensor, eps: float, unit_offset: bool, group: int
) -> tuple[torch.Tensor, torch.Tensor]:
    return _rms_norm_groups(x, None, weight, eps, unit_offset, group)[1:]


@fp8_ops.add_rms_norm_groups.register_kernel("cuda")
def add_rms_norm_groups(
    residual: torch.Tensor,
    delta: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    unit_offset: bool,
    group: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _rms_norm_groups(residual, delta, weight, eps, unit_offset, group)


def _rms_norm_groups(
    x: torch.Tensor,
    delta: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    unit_offset: bool,
    group: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x + delta, or x with no delta; padded FP8 rows of its RMSNorm; their group scales)."""
    x, delta, total = _with_delta(x, delta)
    rows, cols = x.shape
    q, scale, block, warps = _group_outputs(rows, cols, group, x)
    if q.shape[0]:
        _rms_norm_groups_kernel[(q.shape[0],)](
            x, delta, total, weight, q, scale, rows, cols, x.stride(0), q.stride(0),
            scale.stride(1), eps,
            UNIT_OFFSET=unit_offset, HAS_DELTA=total is not x, BLOCK=block, GROUP=group,
            num_warps=warps,
        )  # fmt: skip
    return total, q, scale


@fp8_ops.silu_mul_groups.register_kernel("cuda")
def silu_mul_groups(gate_up: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    gate_up = gate_up if gate_up.stride(-1) == 1 else gate_up.contiguous()
    rows, cols = gate_up.shape[0], gate_up.shape[1] // 2
    q, scale, block, warps = _group_outputs(rows, cols, group, gate_up)
    if q.shape[0]:
        _silu_mul_groups_kernel[(q.shape[0],)](
            gate_up, q, scale, rows, cols, gate_up.stride(0), q.stride(0), scale.stride(1),
            BLOCK=block, GROUP=group, num_warps=warps,
        )  # fmt: skip
    return q, scale
