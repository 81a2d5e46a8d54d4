"""Layers shared by the architectures: activations, norms, rotary embeddings, gated MLP."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from vecpool.errors import ConfigError
from vecpool.models.hf import hf_get


def compiled_for_cuda(x: torch.Tensor) -> bool:
    """Whether `x` is being traced into a layer compiled for CUDA: where `gelu` and
    `add_linear` take their ops (the tests run those paths on the CPU by patching this)."""
    return x.is_cuda and torch.compiler.is_compiling()


# Whether compiled layers on CUDA call ATen's GELU kernel (`vecpool::gelu`) rather than the
# compiler's own (False: a benchmark's baseline). Read when a layer is compiled.
COMPILED_ATEN_GELU = True


def gelu(x: torch.Tensor) -> torch.Tensor:
    """The exact GELU, `F.gelu`; inside a layer compiled for CUDA, through `vecpool::gelu`, an
    op opaque to the compiler, so that ATen's kernel runs rather than the one the compiler
    generates for it. The two compute the same float32 formula (erf, then one rounding); at
    BERT-base's width and a step of 32,768 tokens ATen's took 130 us on the H200 and the
    compiler's 203 us, a copy of the same tensor by the compiler 156 us
    (`benchmarks/lab/activation_check.py`, `activation_check_h200.json`)."""
    if COMPILED_ATEN_GELU and compiled_for_cuda(x):
        return torch.ops.vecpool.gelu(x)
    return F.gelu(x)


@torch.library.custom_op("vecpool::gelu", mutates_args=())
def _gelu_op(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x)


@_gelu_op.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


# Whether layers compiled for CUDA accumulate a projection into its residual in place
# (`add_linear`; False: a benchmark's baseline). Read when a layer is compiled.
COMPILED_RESIDUAL_IN_PLACE = True


def add_linear(residual: torch.Tensor, linear: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """`residual + linear(x)`, where the caller gives `residual` up: inside a layer compiled
    for CUDA, for a plain linear without bias, one matrix product accumulated into `residual`
    in place (`vecpool::add_linear_`). The compiler's own rewrite of the sum, `addmm(residual,
    x, w)` into a new tensor, has ATen copy `residual` there first: a device-to-device copy of
    `[tokens, hidden]` per sum, 3% of Qwen3-0.6B's device time on passages for the two of a
    layer (`phases_kernels_qwen3_bert_h200.json`). The product is the same cuBLAS call.
    Decoder layers use it (Qwen3-0.6B 1.021x / 1.029x on queries / passages,
    `ab_residuals_in_place_qwen3-0.6b_h200.json`); ModernBERT's did not gain (0.94x / 1.00x,
    `ab_residuals_in_place_modernbert_h200.json`)."""
    if (
        COMPILED_RESIDUAL_IN_PLACE
        and compiled_for_cuda(residual)
        and type(linear) is nn.Linear
        and linear.bias is None
    ):
        torch.ops.vecpool.add_linear_(residual, x, linear.weight)
        return residual
    return residual + linear(x)


@torch.library.custom_op("vecpool::add_linear_", mutates_args=("residual",))
def _add_linear_op(residual: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> None:
    torch.addmm(residual, x, weight.t(), out=residual)


# Every activation vecpool applies, by the names configs use: Hugging Face's `hidden_act`, and
# (lower-cased, module path dropped) the torch classes sentence-transformers saves for Dense
# modules and cross-encoder heads. Softmax is over the last axis.
_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu": gelu,
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_fast": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
    "silu": F.silu,
    "swish": F.silu,
    "tanh": torch.tanh,
    "sigmoid": torch.sigmoid,
    "softmax": lambda x: torch.softmax(x, dim=-1),
    "identity": lambda x: x,
}


def activation_name(name: str) -> str:
    """The table's name for `name`: a `hidden_act` as it is, a torch class path
    ("torch.nn.modules.activation.Tanh") by its lower-cased class name; `ConfigError` if unknown."""
    key = name if name in _ACTIVATIONS else name.rsplit(".", 1)[-1].lower()
    if key not in _ACTIVATIONS:
        raise ConfigError(f"activation {name!r} is not supported; known: {sorted(_ACTIVATIONS)}")
    return key


def activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """The activation function `name` names (see `activation_name`)."""
    return _ACTIVATIONS[activation_name(name)]


class RMSNorm(nn.Module):
    """Root-mean-square norm through torch's fused kernel, which accumulates in float32 for
    half inputs. `unit_offset` scales by (1 + weight), all in float32 (Gemma)."""

    def __init__(self, dim: int, eps: float, unit_offset: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim))
        self.eps = eps
        self.unit_offset = unit_offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = (x.shape[-1],)
        if self.unit_offset:
            weight = 1.0 + self.weight.float()
            return F.rms_norm(x.float(), shape, weight, self.eps).to(x.dtype)
        return F.rms_norm(x, shape, self.weight, self.eps)


class FusedProjections(nn.Module):
    """Linears over the same input, computed as one matmul; outputs split back in order.

    Models keep the checkpoint's separate projections (`q_proj`, `k_proj`, ...) so that names
    map directly; once loaded, `fuse()` joins them here and drops the originals.
    """

    def __init__(self, parts: list[nn.Linear]):
        super().__init__()
        self.sizes = [p.out_features for p in parts]
        self.weight = nn.Parameter(torch.cat([p.weight for p in parts]), requires_grad=False)
        biases = [p.bias for p in parts]
        self.bias = (
            nn.Parameter(torch.cat(biases), requires_grad=False)  # type: ignore[arg-type]
            if all(b is not None for b in biases)
            else None
        )

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return F.linear(x, self.weight, self.bias).split(self.sizes, dim=-1)


def fuse(module: nn.Module, fused_name: str, part_names: list[str]) -> None:
    """Replace `module`'s linears `part_names` by one `FusedProjections` named `fused_name`."""
    parts = [getattr(module, name) for name in part_names]
    # Quantized parts (a checkpoint stored in FP8) fuse by their own class's rule.
    fuse_parts = getattr(type(parts[0]), "fuse_parts", None)
    setattr(module, fused_name, fuse_parts(parts) if fuse_parts else FusedProjections(parts))
    for name in part_names:
        delattr(module, name)


class GatedMLP(nn.Module):
    """`down(act(gate(x)) * up(x))`, the decoder MLP; gate and up run as one matmul once fused."""

    def __init__(self, hidden: int, intermediate: int, act: str, bias: bool = False):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.up_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.down_proj = nn.Linear(intermediate, hidden, bias=bias)
        self.act = activation(act)
        self.gate_up_proj: FusedProjections | None = None

    def fuse_projections(self) -> None:
        fuse(self, "gate_up_proj", ["gate_proj", "up_proj"])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.gated(x))

    def add_to(self, residual: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """`residual + self(x)`; `residual` may be overwritten (`add_linear`)."""
        return add_linear(residual, self.down_proj, self.gated(x))

    def gated(self, x: torch.Tensor) -> torch.Tensor:
        """`act(gate(x)) * up(x)`, the input of `down_proj`."""
        assert self.gate_up_proj is not None, "projections are fused when the weights load"
        gate, up = self.gate_up_proj(x)
        return self.act(gate) * up


class Rotary:
    """Rotary position embedding: inverse frequencies from the config, cos/sin per step."""

    def __init__(self, head_dim: int, hf: dict[str, Any]):
        params = dict(hf.get("rope_parameters") or {})
        scaling = dict(hf.get("rope_scaling") or {})
        params = {**scaling, **params}
        base = float(
            hf_get(params, "rope_theta", default=hf_get(hf, "rope_theta", default=10000.0))
        )
        rope_type = params.get("rope_type", params.get("type", "default"))
        # The factor may sit at the top level or among the rope parameters.
        if (
            float(
                hf_get(
                    params, "partial_rotary_factor", default=hf.get("partial_rotary_factor", 1.0)
                )
            )
            != 1.0
        ):
            raise ConfigError(
                "partial rotary embeddings (partial_rotary_factor < 1) are not supported"
            )
        # On the CPU explicitly: models are built under `torch.device("meta")`, and these
        # frequencies are real values, not parameters the loader fills.
        exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
        inv_freq = 1.0 / (base**exponents)  # [head_dim / 2] float32
        if rope_type == "linear":
            inv_freq = inv_freq / float(params["factor"])
        elif rope_type == "llama3":
            inv_freq = _llama3_inv_freq(inv_freq, params)
        elif rope_type != "default":
            raise ConfigError(f"rope type {rope_type!r} is not supported (default, linear, llama3)")
        self.inv_freq = inv_freq
        self._device_inv_freq: torch.Tensor | None = None

    def cos_sin(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`[num_tokens, head_dim]` cos and sin for `positions` (`[num_tokens]`), in `dtype`."""
        inv_freq = self._device_inv_freq
        if inv_freq is None or inv_freq.device != positions.device:
            inv_freq = self._device_inv_freq = self.inv_freq.to(positions.device)
        freqs = positions.float()[:, None] * inv_freq[None, :]  # [T, head_dim / 2] float32
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)


def _llama3_inv_freq(inv_freq: torch.Tensor, params: dict[str, Any]) -> torch.Tensor:
    factor = float(params["factor"])
    low, high = float(params["low_freq_factor"]), float(params["high_freq_factor"])
    old_len = float(params["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old_len / high) & ~(wavelen > old_len / low)
    return torch.where(medium, smoothed, scaled)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate `x` (`[num_tokens, heads, head_dim]`) by per-token `cos`/`sin` (`[num_tokens, head_dim]`)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def linear_activation(linear: nn.Module, x: torch.Tensor, act: str) -> torch.Tensor:
    """`activation(act)(linear(x))`, as one kernel where the linear can apply the activation
    itself (the CPU's prepacked linears offer `fused_activation`, None when they cannot)."""
    fused = getattr(linear, "fused_activation", None)
    out = fused(x, act) if fused is not None else None
    return out if out is not None else activation(act)(linear(x))


def linear_residual(linear: nn.Module, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """`linear(x) + residual`, as one kernel where the linear can add it itself (the CPU's
    prepacked linears offer `fused_add`)."""
    fused = getattr(linear, "fused_add", None)
    return fused(x, residual) if fused is not None else linear(x) + residual
