"""Checkpoints stored in FP8: which linears they quantized, and FP8 layers to load them into.

compressed-tensors (llm-compressor's `FP8_DYNAMIC` and `FP8` schemes) stores a quantized
linear as `weight` in float8_e4m3fn plus `weight_scale`, one float per output channel
(`[N, 1]`) or per tensor (`[]` / `[1]`), and with static activations an `input_scale`. The
loader asks `fp8_checkpoint_layers` for an `Fp8Linear` in place of each linear the checkpoint
stores a `weight_scale` for, then matches every tensor strictly as usual. Block-wise FP8
(`quant_method: "fp8"`, `weight_scale_inv` per 128 x 128 block, as DeepSeek-V3 and Qwen3-FP8
ship) is not read yet.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from vecpool.errors import ModelLoadError

CHECKPOINT_QUANT_METHODS = ("compressed-tensors",)
_FP8_SAFETENSORS = "F8_E4M3"
_SCALE = ".weight_scale"


def fp8_checkpoint_layers(
    model: nn.Module,
    hf: dict[str, Any],
    stored: dict[str, tuple[Path, list[int]]],
    parameter_name: Callable[[str], str | None],
    dtype: torch.dtype,
) -> int:
    """Replace (on the meta device) each linear of `model` whose checkpoint tensors are FP8 by
    an `Fp8Linear` shaped for them; returns how many. `stored` is the checkpoint's key ->
    (file, shape); `parameter_name` maps a key to the parameter it fills."""
    config = hf.get("quantization_config")
    if not config:
        return 0
    method = config.get("quant_method")
    if method not in CHECKPOINT_QUANT_METHODS:
        raise ModelLoadError(
            f"quantization_config quant_method {method!r} is not supported "
            f"({', '.join(CHECKPOINT_QUANT_METHODS)} with FP8 weights)"
        )
    _check_schemes(config)
    from vecpool.models.quant import Fp8Linear

    fp8_weights = _fp8_weights(stored)
    scaled = {key[: -len(_SCALE)] for key in stored if key.endswith(_SCALE)}
    for prefix in sorted(set(fp8_weights) - scaled):
        raise ModelLoadError(
            f"{fp8_weights[prefix].name}: {prefix + '.weight'!r} is FP8, but the checkpoint has "
            f"no {prefix + _SCALE!r}"
        )
    for prefix in sorted(scaled - set(fp8_weights)):
        weight = prefix + ".weight"
        what = f"is not {_FP8_SAFETENSORS}" if weight in stored else "is not in the checkpoint"
        raise ModelLoadError(f"the checkpoint has {prefix + _SCALE!r}, but {weight!r} {what}")
    swapped = 0
    for prefix in sorted(scaled):
        name = parameter_name(prefix + ".weight")
        if name is None:
            continue  # the strict match names its tensors as unexpected
        module_name = name.rpartition(".")[0]
        linear = model.get_submodule(module_name)
        if not isinstance(linear, nn.Linear):
            raise ModelLoadError(f"{prefix + _SCALE!r} scales {module_name!r}, not a linear layer")
        input_scale = stored.get(prefix + ".input_scale")
        parent_name, _, attr = module_name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(
            parent,
            attr,
            Fp8Linear(
                linear.in_features,
                linear.out_features,
                bias=linear.bias is not None,
                out_dtype=dtype,
                scale_shape=tuple(stored[prefix + _SCALE][1]),
                input_scale_shape=tuple(input_scale[1]) if input_scale else None,
            ),
        )
        swapped += 1
    return swapped


def _check_schemes(config: dict[str, Any]) -> None:
    """Raise naming a compressed-tensors scheme other than FP8 weights per channel or tensor
    with per-token or static per-tensor activations."""
    for name, group in (config.get("config_groups") or {}).items():
        weights = group.get("weights") or {}
        if weights.get("num_bits") != 8 or weights.get("type") != "float":
            raise ModelLoadError(
                f"quantization_config group {name!r}: weights of {weights.get('num_bits')} bits "
                f"of type {weights.get('type')!r}; only FP8 (8-bit float) is read"
            )
        if weights.get("strategy") not in ("channel", "tensor"):
            raise ModelLoadError(
                f"quantization_config group {name!r}: weight strategy "
                f"{weights.get('strategy')!r}; only 'channel' and 'tensor' are read"
            )


def _fp8_weights(stored: dict[str, tuple[Path, list[int]]]) -> dict[str, Path]:
    """The prefix of every `*.weight` stored in FP8 -> its file (dtypes from the headers)."""
    found: dict[str, Path] = {}
    for path in sorted({path for path, _ in stored.values()}):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for key in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                if key.endswith(".weight") and f.get_slice(key).get_dtype() == _FP8_SAFETENSORS:
                    found[key[: -len(".weight")]] = path
    return found
