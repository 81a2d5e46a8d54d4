"""The FP8 row-quantization steps as `torch.library` custom ops (`vecpool::fp8_*`).

Each op turns rows into FP8 rows and one float32 scale per row (`quant.quantize_rows`), after
computing them: as they are, as an RMSNorm, or as SiLU(gate) * up. Being ops, torch.compile
traces each as one step (with the shapes of `register_fake`), and CUDA graphs record them.
The CPU kernel here is the reference math in torch, float32 inside; `fp8_kernels` registers
the one-pass Triton kernels for CUDA.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from vecpool.models.quant import FP8_DTYPE, quantize_rows


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
