"""The FP8 row-quantization steps as `torch.library` custom ops (`vecpool::fp8_*`).

Each op turns rows into FP8 rows and one float32 scale per row (`quantize.quantize_rows`), after
computing them: as they are, as an RMSNorm, or as SiLU(gate) * up. The `*_groups` ops do the
same with one scale per row and group of inputs (`quantize.quantize_groups`), for block-wise
FP8 weights: their rows padded with zeros to a multiple of 16 and their scales laid out with
the rows adjacent, as cuBLAS's block-scaled product reads them. Being ops, torch.compile
traces each as one step (with the shapes of `register_fake`), and CUDA graphs record them.
The CPU kernel here is the reference math in torch, float32 inside; `fp8_kernels` registers
the one-pass Triton kernels for CUDA.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from vecpool.models.quant.quantize import (
    FP8_DTYPE,
    ROW_ALIGN,
    QuantizedRows,
    quantize_groups,
    quantize_rows,
)


def _fake(rows: torch.Tensor, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
    return (
        rows.new_empty((rows.shape[0], cols), dtype=FP8_DTYPE),
        rows.new_empty((rows.shape[0], 1), dtype=torch.float32),
    )


@torch.library.custom_op("vecpool::fp8_quant_rows", mutates_args=(), device_types="cpu")
def quant_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`[M, K]` rows -> (`[M, K]` FP8, `[M, 1]` float32 scales), per-row amax / 448."""
    return tuple(quantize_rows(x))  # type: ignore[return-value]


@quant_rows.register_fake
def _(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return _fake(x, x.shape[1])


@torch.library.custom_op("vecpool::fp8_rms_norm", mutates_args=(), device_types="cpu")
def rms_norm_rows(
    x: torch.Tensor, weight: torch.Tensor, eps: float, unit_offset: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm of `[M, K]` rows (float32 inside; `unit_offset`: scaled by 1 + weight), emitted
    as FP8 rows and their scales."""
    w = weight.float() + 1.0 if unit_offset else weight.float()
    return tuple(quantize_rows(F.rms_norm(x.float(), (x.shape[-1],), w, eps)))  # type: ignore[return-value]


@rms_norm_rows.register_fake
def _(
    x: torch.Tensor, weight: torch.Tensor, eps: float, unit_offset: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    return _fake(x, x.shape[1])


@torch.library.custom_op("vecpool::fp8_silu_mul", mutates_args=(), device_types="cpu")
def silu_mul_rows(gate_up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`[M, 2I]` (gate | up) -> SiLU(gate) * up (float32 inside) as `[M, I]` FP8 and scales."""
    gate, up = gate_up.float().chunk(2, dim=-1)
    return tuple(quantize_rows(F.silu(gate) * up))  # type: ignore[return-value]


@silu_mul_rows.register_fake
def _(gate_up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return _fake(gate_up, gate_up.shape[1] // 2)


def padded_rows(rows: int) -> int:
    """The row count of a `*_groups` op's outputs for `rows` input rows."""
    return -(-rows // ROW_ALIGN) * ROW_ALIGN


def _groups(y: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 rows -> padded FP8 rows and their group scales, rows adjacent ([Mp, G] with
    strides (1, Mp))."""
    rows: QuantizedRows = quantize_groups(
        F.pad(y, (0, 0, 0, padded_rows(y.shape[0]) - y.shape[0])), group
    )
    return rows.data, rows.scale.t().contiguous().t()


def _fake_groups(rows: torch.Tensor, cols: int, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    padded, groups = padded_rows(rows.shape[0]), -(-cols // group)
    return (
        rows.new_empty((padded, cols), dtype=FP8_DTYPE),
        rows.new_empty_strided((padded, groups), (1, padded), dtype=torch.float32),
    )


@torch.library.custom_op("vecpool::fp8_quant_groups", mutates_args=(), device_types="cpu")
def quant_groups(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`[M, K]` rows -> (`[Mp, K]` FP8, `[Mp, ceil(K / group)]` float32 scales)."""
    return _groups(x.float(), group)


@quant_groups.register_fake
def _(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    return _fake_groups(x, x.shape[1], group)


@torch.library.custom_op("vecpool::fp8_rms_norm_groups", mutates_args=(), device_types="cpu")
def rms_norm_groups(
    x: torch.Tensor, weight: torch.Tensor, eps: float, unit_offset: bool, group: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm of `[M, K]` rows (as `fp8_rms_norm`), emitted as padded FP8 rows and group
    scales."""
    w = weight.float() + 1.0 if unit_offset else weight.float()
    return _groups(F.rms_norm(x.float(), (x.shape[-1],), w, eps), group)


@rms_norm_groups.register_fake
def _(
    x: torch.Tensor, weight: torch.Tensor, eps: float, unit_offset: bool, group: int
) -> tuple[torch.Tensor, torch.Tensor]:
    return _fake_groups(x, x.shape[1], group)


@torch.library.custom_op("vecpool::fp8_silu_mul_groups", mutates_args=(), device_types="cpu")
def silu_mul_groups(gate_up: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`[M, 2I]` (gate | up) -> SiLU(gate) * up as padded `[Mp, I]` FP8 rows and group scales."""
    gate, up = gate_up.float().chunk(2, dim=-1)
    return _groups(F.silu(gate) * up, group)


@silu_mul_groups.register_fake
def _(gate_up: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    return _fake_groups(gate_up, gate_up.shape[1] // 2, group)


# ---- a residual sum, then the RMSNorm of it (a pre-norm layer's next input) -------------------


@torch.library.custom_op("vecpool::fp8_add_rms_norm", mutates_args=(), device_types="cpu")
def add_rms_norm_rows(
    residual: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float, unit_offset: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`residual + delta` (`[M, K]`, the residual's dtype), and its RMSNorm as `fp8_rms_norm`
    emits it (FP8 rows, per-row scales): the sum that a pre-norm layer carries on and the
    input of the projection after it, from one pass over both."""
    total = residual + delta  # rounded once to the residual's dtype
    return (total, *rms_norm_rows(total, weight, eps, unit_offset))


@add_rms_norm_rows.register_fake
def _(
    residual: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float, unit_offset: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return (torch.empty_like(residual), *_fake(residual, residual.shape[1]))


@torch.library.custom_op("vecpool::fp8_add_rms_norm_groups", mutates_args=(), device_types="cpu")
def add_rms_norm_groups(
    residual: torch.Tensor,
    delta: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    unit_offset: bool,
    group: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`residual + delta`, and its RMSNorm as `fp8_rms_norm_groups` emits it."""
    total = residual + delta  # rounded once to the residual's dtype
    return (total, *rms_norm_groups(total, weight, eps, unit_offset, group))


@add_rms_norm_groups.register_fake
def _(
    residual: torch.Tensor,
    delta: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    unit_offset: bool,
    group: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return (torch.empty_like(residual), *_fake_groups(residual, residual.shape[1], group))
