"""Checkpoints stored in FP8: which linears they quantized, and FP8 layers to load them into.

Two forms are read. compressed-tensors (llm-compressor's `FP8_DYNAMIC`, `FP8` and `FP8_BLOCK`
schemes) stores a quantized linear as `weight` in float8_e4m3fn plus `weight_scale`, one float
per output channel (`[N, 1]`) or per tensor (`[]` / `[1]`): an `Fp8Linear`; or one per
`block_structure` block: an `Fp8BlockLinear`. Hugging Face's fine-grained FP8 (`quant_method`
"fp8", as DeepSeek-V3 and the Qwen3 FP8 releases ship) stores `weight` plus
`weight_scale_inv`, one factor per `weight_block_size` block: an `Fp8BlockLinear`. With static activations either may add an `input_scale`. The loader asks
`fp8_checkpoint_layers` for the FP8 layer in place of each linear the checkpoint stores a
scale for, then matches every tensor strictly as usual.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from vecpool.errors import ModelLoadError
from vecpool.models.hf import CHECKPOINT_QUANT_METHODS
from vecpool.models.quant.fp8_block import Fp8BlockLinear
from vecpool.models.quant.linear import Fp8Linear

_FP8_SAFETENSORS = "F8_E4M3"
# The weight scale's name in each form.
_SCALES = {"compressed-tensors": ".weight_scale", "fp8": ".weight_scale_inv"}


def fp8_checkpoint_layers(
    model: nn.Module,
    hf: dict[str, Any],
    stored: dict[str, tuple[Path, list[int]]],
    parameter_name: Callable[[str], str | None],
    dtype: torch.dtype,
) -> int:
    """Replace (on the meta device) each linear of `model` whose checkpoint tensors are FP8 by
    the FP8 layer of the checkpoint's form (`Fp8Linear`, `Fp8BlockLinear`) shaped for them;
    returns how many. `stored` is the checkpoint's key ->
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
    block = _check_schemes(config)
    suffix = _SCALES[method]
    fp8_weights = _fp8_weights(stored)
    scaled = {key[: -len(suffix)] for key in stored if key.endswith(suffix)}
    for prefix in sorted(set(fp8_weights) - scaled):
        raise ModelLoadError(
            f"{fp8_weights[prefix].name}: {prefix + '.weight'!r} is FP8, but the checkpoint has "
            f"no {prefix + suffix!r}"
        )
    for prefix in sorted(scaled - set(fp8_weights)):
        weight = prefix + ".weight"
        what = f"is not {_FP8_SAFETENSORS}" if weight in stored else "is not in the checkpoint"
        raise ModelLoadError(f"the checkpoint has {prefix + suffix!r}, but {weight!r} {what}")
    swapped = 0
    for prefix in sorted(scaled):
        name = parameter_name(prefix + ".weight")
        if name is None:
            continue  # the strict match names its tensors as unexpected
        module_name = name.rpartition(".")[0]
        linear = model.get_submodule(module_name)
        if not isinstance(linear, nn.Linear):
            raise ModelLoadError(f"{prefix + suffix!r} scales {module_name!r}, not a linear layer")
        input_scale = stored.get(prefix + ".input_scale")
        parent_name, _, attr = module_name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        input_scale_shape = tuple(input_scale[1]) if input_scale else None
        layer: nn.Module
        if block is None:
            layer = Fp8Linear(
                linear.in_features,
                linear.out_features,
                bias=linear.bias is not None,
                out_dtype=dtype,
                scale_shape=tuple(stored[prefix + suffix][1]),
                input_scale_shape=input_scale_shape,
            )
        else:
            layer = Fp8BlockLinear(
                linear.in_features,
                linear.out_features,
                block=block,
                bias=linear.bias is not None,
                out_dtype=dtype,
                input_scale_shape=input_scale_shape,
                scale_name=suffix.removeprefix("."),
            )
        setattr(parent, attr, layer)
        swapped += 1
    return swapped


def _check_schemes(config: dict[str, Any]) -> tuple[int, int] | None:
    """The weight block (rows, columns) of a block-wise FP8 config, None for weights per
    channel or tensor; raise naming any other scheme."""
    if config.get("quant_method") == "fp8":
        return _block(config.get("weight_block_size"), "weight_block_size")
    blocks = set()
    for name, group in (config.get("config_groups") or {}).items():
        weights = group.get("weights") or {}
        if weights.get("num_bits") != 8 or weights.get("type") != "float":
            raise ModelLoadError(
                f"quantization_config group {name!r}: weights of {weights.get('num_bits')} bits "
                f"of type {weights.get('type')!r}; only FP8 (8-bit float) is read"
            )
        strategy = weights.get("strategy")
        if strategy not in ("channel", "tensor", "block"):
            raise ModelLoadError(
                f"quantization_config group {name!r}: weight strategy {strategy!r}; only "
                "'channel', 'tensor' and 'block' are read"
            )
        blocks.add(
            _block(weights.get("block_structure"), f"group {name!r} block_structure")
            if strategy == "block"
            else None
        )
    if len(blocks) > 1:
        raise ModelLoadError(
            "quantization_config mixes block-wise FP8 weights with per-channel or per-tensor "
            "ones (or blocks of several shapes); vecpool reads one form per checkpoint"
        )
    return blocks.pop() if blocks else None


def _block(value: Any, what: str) -> tuple[int, int]:
    if not (
        isinstance(value, list)
        and len(value) == 2
        and all(isinstance(b, int) and b > 0 for b in value)
    ):
        raise ModelLoadError(
            f"quantization_config {what} {value!r}; expected two positive integers (rows, "
            "columns of a block), e.g. [128, 128]"
        )
    return value[0], value[1]


def _fp8_weights(stored: dict[str, tuple[Path, list[int]]]) -> dict[str, Path]:
    """The prefix of every `*.weight` stored in FP8 -> its file (dtypes from the headers)."""
    found: dict[str, Path] = {}
    for path in sorted({path for path, _ in stored.values()}):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for key in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                if key.endswith(".weight") and f.get_slice(key).get_dtype() == _FP8_SAFETENSORS:
                    found[key[: -len(".weight")]] = path
    return found
