"""The FP8 row-quantization steps as `torch.library` operators (`vecpool::fp8_*`).

Each op turns rows into FP8 rows and one float32 scale per row (`quant.quantize_rows`), after
computing them: as they are, as an RMSNorm, or as SiLU(gate) * up. The `*_groups` ops do the
same with one scale per row and group of inputs (`fp8_block.quantize_groups`), for block-wise
FP8 weights: their rows padded with zeros to a multiple of 16 and their scales laid out with
the rows adjacent, as cuBLAS's block-scaled product reads them. Each op is a
`torch.library.triton_op` (`triton_ops`): on CUDA its body launches the one-pass Triton kernel
of `fp8_kernels`, which compiled layers launch from their own generated code; elsewhere it is
the reference math in torch, float32 inside (the same function gives the compiler the outputs'
shapes). CUDA graphs record them either way.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from vecpool.models.fp8_block import ROW_ALIGN, quantize_groups
from vecpool.models.quant import QuantizedRows, quantize_rows


def _kernels() -> Any:
    """The CUDA kernels (`fp8_kernels`, which imports Triton: only where a CUDA op runs)."""
    from vecpool.models import fp8_kernels

    return fp8_kernels


@torch.library.triton_op("vecpool::fp8_quant_rows", mutates_args=())
def quant_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`[M, K]` rows -> (`[M, K]` FP8, `[M, 1]` float32 scales), per-row amax / 448."""
    if x.is_cuda:
        return _kernels().quant_rows(x)
    return tuple(quantize_rows(x))  # type: ignore[return-value]


@torch.library.triton_op("vecpool::fp8_rms_norm", mutates_args=())
def rms_norm_rows(
    x: torch.Tensor, weight: torch.Tensor, eps: float, unit_offset: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm of `[M, K]` rows (float32 inside; `unit_offset`: scaled by 1 + weight), emitted
    as FP8 rows and their scales."""
    if x.is_cuda:
        return _kernels().rms_norm_rows(x, weight, eps, unit_offset)
    w = weight.float() + 1.0 if unit_offset else weight.float()
    return tuple(quantize_rows(F.rms_norm(x.float(), (x.shape[-1],), w, eps)))  # type: ignore[return-value]


@torch.library.triton_op("vecpool::fp8_silu_mul", mutates_args=())
def silu_mul_rows(gate_up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`[M, 2I]` (gate | up) -> SiLU(gate) * up (float32 inside) as `[M, I]` FP8 and scales."""
    if gate_up.is_cuda:
        return _kernels().silu_mul_rows(gate_up)
    gate, up = gate_up.float().chunk(2, dim=-1)
    return tuple(quantize_rows(F.silu(gate) * up))  # type: ignore[return-value]


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


@torch.library.triton_op("vecpool::fp8_quant_groups", mutates_args=())
def quant_groups(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`[M, K]` rows -> (`[Mp, K]` FP8, `[Mp, ceil(K / group)]` float32 scales)."""
    if x.is_cuda:
        return _kernels().quant_groups(x, group)
    return _groups(x.float(), group)


@torch.library.triton_op("vecpool::fp8_rms_norm_groups", mutates_args=())
def rms_norm_groups(
    x: torch.Tensor, weight: torch.Tensor, eps: float, unit_offset: bool, group: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm of `[M, K]` rows (as `fp8_rms_norm`), emitted as padded FP8 rows and group
    scales."""
    if x.is_cuda:
        return _kernels().rms_norm_groups(x, weight, eps, unit_offset, group)
    w = weight.float() + 1.0 if unit_offset else weight.float()
    return _groups(F.rms_norm(x.float(), (x.shape[-1],), w, eps), group)


@torch.library.triton_op("vecpool::fp8_silu_mul_groups", mutates_args=())
def silu_mul_groups(gate_up: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`[M, 2I]` (gate | up) -> SiLU(gate) * up as padded `[Mp, I]` FP8 rows and group scales."""
    if gate_up.is_cuda:
        return _kernels().silu_mul_groups(gate_up, group)
    gate, up = gate_up.float().chunk(2, dim=-1)
    return _groups(F.silu(gate) * up, group)
