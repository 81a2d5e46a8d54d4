"""Where an engine runs: the model's device and dtype as torch objects (`resolve_device`,
`resolve_dtype`). Engine-side: it imports torch."""

from __future__ import annotations

import torch

from vecpool.errors import ConfigError

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}


def resolve_device(device: str | torch.device | None) -> torch.device:
    """`None` picks CUDA when available, else the CPU."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ConfigError(f"device {device!r} is not a torch device: {exc}") from None
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device {device!r} was asked for, but CUDA is not available")
    return resolved


def resolve_dtype(
    dtype: str | torch.dtype | None, device: torch.device, checkpoint_dtype: str | None
) -> torch.dtype:
    """`None` means float32 on the CPU; on CUDA the checkpoint's half type, else float16."""
    if isinstance(dtype, torch.dtype):
        if dtype not in _DTYPES.values():
            raise ConfigError(f"dtype {dtype} is not supported; use float32, float16 or bfloat16")
        return dtype
    if dtype is not None and dtype != "auto":
        if dtype not in _DTYPES:
            raise ConfigError(
                f"dtype {dtype!r} is not supported; use one of {sorted(set(_DTYPES))} or 'auto'"
            )
        return _DTYPES[dtype]
    if device.type == "cpu":
        return torch.float32
    if checkpoint_dtype in ("bfloat16", "float16"):
        return _DTYPES[checkpoint_dtype]
    return torch.float16
