"""Quantized projections of the layer stack: FP8 on CUDA (Ada / Hopper), int8 on the CPU.

Both quantize weights once, per output channel, and activations dynamically, per token (each
row of the flat batch gets its own scale from its values: FP8 from its amax, int8 from its least
and largest value), so a row's result never depends on the other rows of its step. Embeddings, norms and heads stay in the model's dtype: only the
linears inside the repeated layers are swapped (`quantize_model`).

FP8 (`float8_e4m3fn`, largest value 448) multiplies through `torch._scaled_mm` with row-wise
scales; on CUDA the rows are quantized by the Triton kernels of `fp8_kernels`, fused into the
RMSNorm or SiLU * up that produces them where a pre-norm decoder layer allows, and a stack of
such layers adds each residual sum in the norm that reads it (`decoder.SumInNormLayer`). Off
CUDA the same math runs in torch (`quantize.quantize_rows`, and the product of the FP8 values
accumulated in float32, then scaled), which is what the tests check. Int8 (`int8.Int8Linear`)
multiplies uint8 rows by int8 weights in int32 through FBGEMM, then scales. Checkpoints stored with one FP8 scale per block of the weight load
into `fp8_block.Fp8BlockLinear`, which takes the same norm folding.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from vecpool.config import QUANTIZATIONS
from vecpool.errors import ConfigError
from vecpool.models.architectures.decoder import DecoderLayer, SumInNormLayer
from vecpool.models.layers.basic import FusedProjections, GatedMLP, RMSNorm
from vecpool.models.quant.fp8_block import Fp8BlockLinear
from vecpool.models.quant.int8 import (
    Int8Linear,
    default_int8_kernel,
    full_range_exact,
    input_amax,
)
from vecpool.models.quant.quantize import (
    FP8_DTYPE,
    QuantizedRows,
    bias_and_input_scale,
    quantize_rows,
)

logger = logging.getLogger(__name__)

FP8_MIN_CAPABILITY = (8, 9)  # Ada and Hopper multiply FP8
# torch._scaled_mm needs both dimensions of the weight to be multiples of 16.
_FP8_ALIGN = 16
# Whether decoder stacks whose norms all fold into FP8 projections add their residual sums in
# the norms' kernels (`decoder.SumInNormLayer`); False keeps a sum per layer output (the baseline
# of `benchmarks/lab/ab_run_ahead.py --against sum-outside-norm`).
SUM_IN_NORM = True
# How many input channels of each int8 linear stay in float32: those of the largest magnitude
# in the calibration forward (BERT-family encoders carry one or two channels tens of times
# louder than the rest, which would set each row's int8 step). All-MiniLM-L6-v2, minimum /
# median cosine to float32 over 310 mixed texts, then over bench_cpu.py's 128 passages of
# random words: 8-bit rows with 1 channel 0.9969 / 0.99936; 2: 0.9982 / 0.99951, passages
# 0.9982 / 0.99895; 4: 0.9985 / 0.99958, passages 0.9985 / 0.99910. 7-bit rows (a kernel that
# saturates 8-bit ones): 1: 0.9970 / 0.99863; 2: 0.9975 / 0.99897; 4: 0.9971 / 0.99914,
# passages 0.9977 / 0.99869 (8 channels: 0.99880; the rows' 7 bits set it there).
INT8_OUTLIERS = 4
INT8_OUTLIERS_7BIT = 4


def check_quantization(method: str | None, device: torch.device) -> None:
    """Raise `ConfigError` if `method` is unknown or cannot run on `device`."""
    if method is None:
        return
    if method not in QUANTIZATIONS:
        raise ConfigError(f"quantization {method!r} is not one of {QUANTIZATIONS}")
    if method == "fp8":
        if device.type != "cuda":
            raise ConfigError(
                f"quantization='fp8' runs on CUDA devices of compute capability "
                f"{_version(FP8_MIN_CAPABILITY)} or higher (Ada, Hopper); the device is {device} "
                "(on the CPU, quantization='int8')"
            )
        capability = torch.cuda.get_device_capability(device)
        if capability < FP8_MIN_CAPABILITY:
            raise ConfigError(
                f"quantization='fp8' needs compute capability {_version(FP8_MIN_CAPABILITY)} or "
                f"higher (Ada, Hopper); {device} is {torch.cuda.get_device_name(device)}, "
                f"compute capability {_version(capability)}"
            )
    if method == "int8" and device.type != "cpu":
        raise ConfigError(
            f"quantization='int8' runs on the CPU; the device is {device} (on CUDA of compute "
            "capability 8.9 or higher, quantization='fp8')"
        )


def _version(capability: tuple[int, int]) -> str:
    return f"{capability[0]}.{capability[1]}"


def fused_fp8_ops(device: torch.device) -> bool:
    """Whether FP8 rows are quantized by the one-pass Triton kernels on `device` (CUDA with
    FP8, Triton installed); they are the CUDA kernels of `fp8_ops`'s custom ops."""
    if device.type != "cuda" or torch.cuda.get_device_capability(device) < FP8_MIN_CAPABILITY:
        return False
    try:
        import vecpool.models.quant.fp8_kernels  # noqa: F401 - registers the CUDA kernels
    except ImportError:
        return False
    return True


# With `kernels`, rows go through the custom ops of `fp8_ops` (`finish_fp8` imports them), which
# torch.compile traces as single steps.
def _fp8_rows(x: torch.Tensor, kernels: bool) -> QuantizedRows:
    if kernels:
        return QuantizedRows(*torch.ops.vecpool.fp8_quant_rows(x))
    return quantize_rows(x, FP8_DTYPE)


class Fp8Linear(nn.Module):
    """A linear layer whose weight is FP8 with one float32 scale per output channel; inputs
    are quantized per row as they come (or come quantized, as `QuantizedRows`).

    `sizes` splits the output as `FusedProjections` does (q/k/v). A checkpoint stored in FP8
    may carry one scale per tensor (`scale_shape` [] or [1]) or per channel ([N, 1]), and a
    static input scale this layer loads but does not use (its rows are scaled per token, which
    is at least as fine); `finish_scales` turns every form into `[N]`.
    """

    # The dtypes of the parameters as loaded (`restore_fp8_dtypes`).
    PARAM_DTYPES: ClassVar[dict[str, torch.dtype]] = {
        "weight": FP8_DTYPE,
        "weight_scale": torch.float32,
        "input_scale": torch.float32,
    }

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        bias: bool,
        out_dtype: torch.dtype,
        sizes: list[int] | None = None,
        scale_shape: tuple[int, ...] | None = None,
        input_scale_shape: tuple[int, ...] | None = None,
    ):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.sizes = sizes
        self.out_dtype = out_dtype
        # [N, K] float8_e4m3fn
        self.weight = nn.Parameter(
            torch.empty(out_features, in_features, dtype=FP8_DTYPE), requires_grad=False
        )
        # [N] float32 once loaded (a checkpoint's form until `finish_scales`)
        self.weight_scale = nn.Parameter(
            torch.empty(
                (out_features,) if scale_shape is None else scale_shape, dtype=torch.float32
            ),
            requires_grad=False,
        )
        # [N] in out_dtype; a checkpoint's static input scale (loaded, not used)
        self.bias, self.input_scale = bias_and_input_scale(
            out_features, bias, out_dtype, input_scale_shape
        )
        # Set by `set_fp8_backend`: rows quantized by the Triton kernels; products through
        # torch._scaled_mm (else the FP8 values are multiplied in float32 and scaled).
        self.kernels = False
        self.scaled_mm = False
        # Steps of fewer rows than this multiply in `out_dtype`, by `dense_weight`, where FP8
        # was measured slower (`dense_below`; 0: every step in FP8).
        self.fp8_from = 0
        self.dense_weight: torch.Tensor | None  # [N, K] out_dtype, where fp8_from > 0
        self.register_buffer("dense_weight", None, persistent=False)

    @classmethod
    def from_weight(
        cls, weight: torch.Tensor, bias: torch.Tensor | None, sizes: list[int] | None = None
    ) -> Fp8Linear:
        """Quantize a `[N, K]` weight per output channel."""
        with torch.device("meta"):  # filled below
            layer = cls(
                weight.shape[1], weight.shape[0], bias=False, out_dtype=weight.dtype, sizes=sizes
            )
        data, scale = quantize_rows(weight, FP8_DTYPE)
        layer.weight = nn.Parameter(data, requires_grad=False)
        layer.weight_scale = nn.Parameter(scale.view(-1), requires_grad=False)
        if bias is not None:
            layer.bias = nn.Parameter(bias.detach().clone(), requires_grad=False)
        return layer

    @classmethod
    def fuse_parts(cls, parts: list[nn.Module]) -> Fp8Linear:
        """Layers over the same input as one (the checkpoint's q/k/v or gate/up in FP8)."""
        layers = [p for p in parts if isinstance(p, Fp8Linear)]
        if len(layers) != len(parts):
            raise ConfigError(
                "a checkpoint stores some of the projections that share an input in FP8 and "
                "others not; they must be quantized alike"
            )
        for layer in layers:
            layer.finish_scales()
        biases = [p.bias for p in layers]
        with torch.device("meta"):  # filled below
            fused = cls(
                layers[0].in_features,
                sum(p.out_features for p in layers),
                bias=False,
                out_dtype=layers[0].out_dtype,
                sizes=[p.out_features for p in layers],
            )
        fused.weight = nn.Parameter(torch.cat([p.weight for p in layers]), requires_grad=False)
        fused.weight_scale = nn.Parameter(
            torch.cat([p.weight_scale for p in layers]), requires_grad=False
        )
        if all(b is not None for b in biases):
            fused.bias = nn.Parameter(torch.cat(biases), requires_grad=False)  # type: ignore[arg-type]
        return fused

    def finish_scales(self) -> None:
        """Make the weight scale one float32 per output channel (`[N]`)."""
        scale = self.weight_scale.data.float().reshape(-1)
        if scale.numel() == 1:
            scale = scale.expand(self.out_features)
        if scale.numel() != self.out_features:
            raise ConfigError(
                f"weight_scale of {scale.numel()} values for {self.out_features} output "
                "channels: only per-tensor and per-channel FP8 scales are supported"
            )
        self.weight_scale = nn.Parameter(scale.contiguous(), requires_grad=False)

    def dense_below(self, rows: int) -> None:
        """Multiply steps of fewer than `rows` rows in `out_dtype`, by the FP8 weights
        dequantized once (the same weights, the rows unquantized); 0: every step in FP8."""
        self.fp8_from = rows
        self.dense_weight = (
            (self.weight.float() * self.weight_scale.view(-1, 1)).to(self.out_dtype)
            if rows > 0
            else None
        )

    def _dense(self, x: torch.Tensor) -> bool:
        """Whether a step of `x`'s rows multiplies in `out_dtype` (under torch.compile a guard
        on the row count; in a CUDA graph, fixed by the graph's token bucket)."""
        return x.shape[:-1].numel() < self.fp8_from

    def forward(self, x: torch.Tensor | QuantizedRows) -> torch.Tensor | tuple[torch.Tensor, ...]:
        if isinstance(x, QuantizedRows):
            out = self._matmul(x)
        elif self._dense(x):
            out = F.linear(x.to(self.out_dtype), self.dense_weight)  # type: ignore[arg-type]  # set with fp8_from
        else:
            lead = x.shape[:-1]
            out = self._matmul(_fp8_rows(x.reshape(-1, x.shape[-1]), self.kernels))
            out = out.view(*lead, self.out_features)
        if self.bias is not None:
            out = out + self.bias
        return out.split(self.sizes, dim=-1) if self.sizes else out

    def norm_forward(
        self, x: torch.Tensor, norm: RMSNorm
    ) -> torch.Tensor | tuple[torch.Tensor, ...]:
        """This layer of `norm(x)`, the norm writing FP8 rows and their scales directly (the
        `fp8_kernels` RMSNorm on CUDA)."""
        if self._dense(x):
            return self(norm(x))
        if self.kernels:
            n = norm
            rows = QuantizedRows(*torch.ops.vecpool.fp8_rms_norm(x, n.weight, n.eps, n.unit_offset))
        else:
            rows = quantize_rows(norm(x), FP8_DTYPE)
        return self(rows)

    def add_norm_forward(
        self, residual: torch.Tensor, delta: torch.Tensor, norm: RMSNorm
    ) -> tuple[torch.Tensor, torch.Tensor | tuple[torch.Tensor, ...]]:
        """(`residual + delta`, this layer of its norm), on CUDA from one kernel that writes
        the sum, the FP8 rows and their scales."""
        if not self.kernels or self._dense(residual):
            total = residual + delta
            return total, self.norm_forward(total, norm)
        n = norm
        total, *rows = torch.ops.vecpool.fp8_add_rms_norm(
            residual, delta, n.weight, n.eps, n.unit_offset
        )
        return total, self(QuantizedRows(*rows))

    def silu_mul_forward(self, gate_up: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, ...]:
        """This layer of SiLU(gate) * up, which the `fp8_silu_mul` op writes as FP8 rows."""
        if self._dense(gate_up):
            gate, up = gate_up.chunk(2, dim=-1)
            return self(F.silu(gate) * up)
        return self(QuantizedRows(*torch.ops.vecpool.fp8_silu_mul(gate_up)))

    def _matmul(self, rows: QuantizedRows) -> torch.Tensor:  # [M, N] in out_dtype
        if self.scaled_mm:
            # Row-wise scaling: scale_a [M, 1], scale_b [1, N], float32; the weight passed
            # column-major; bf16 out (the only output type row-wise scaling supports).
            out = torch._scaled_mm(
                rows.data,
                self.weight.t(),
                scale_a=rows.scale,
                scale_b=self.weight_scale.view(1, -1),
                out_dtype=torch.bfloat16,
            )
            return out.to(self.out_dtype)
        # FP8 values times FP8 values are exact in float32; accumulate there, then scale.
        acc = rows.data.float() @ self.weight.float().t()
        return (acc * rows.scale * self.weight_scale).to(self.out_dtype)


class Fp8NormLinear(nn.Module):
    """An RMSNorm whose output only feeds one FP8 linear (per channel or in blocks), as one
    step: on CUDA the norm writes FP8 rows and their scales directly (`norm_forward`)."""

    def __init__(self, norm: RMSNorm, linear: Fp8Linear | Fp8BlockLinear):
        super().__init__()
        self.norm = norm
        self.linear = linear

    def forward(self, x: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, ...]:
        return self.linear.norm_forward(x, self.norm)

    def add_forward(
        self, residual: torch.Tensor, delta: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | tuple[torch.Tensor, ...]]:
        """(`residual + delta`, this layer of the sum's norm): a pre-norm layer's residual sum
        and the projection of it that follows, the sum added in the norm's kernel on CUDA."""
        return self.linear.add_norm_forward(residual, delta, self.norm)


class Fp8GatedMLP(nn.Module):
    """`GatedMLP` on FP8 linears, its norm folded in when it has one: with SiLU, the
    activation writes the FP8 input of `down_proj` directly (the `fp8_kernels` SiLU * up)."""

    def __init__(
        self,
        gate_up: Fp8Linear | Fp8BlockLinear,
        down: Fp8Linear | Fp8BlockLinear,
        act: Callable[[torch.Tensor], torch.Tensor],
        norm: RMSNorm | None,
    ):
        super().__init__()
        gate_up.sizes = None  # [M, 2 * intermediate]: gate | up
        self.gate_up_proj: nn.Module = gate_up if norm is None else Fp8NormLinear(norm, gate_up)
        self.down_proj = down
        self.act = act
        # SiLU * up in the kernel that quantizes its rows
        self.fused_silu = down.kernels and act is F.silu

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.gate_up_proj(x))

    def down(self, gate_up: torch.Tensor) -> torch.Tensor:
        """The MLP's output from its gate | up projection (`[M, 2I]`)."""
        if self.fused_silu:
            out = self.down_proj.silu_mul_forward(gate_up)
        else:
            gate, up = gate_up.chunk(2, dim=-1)
            out = self.down_proj(self.act(gate) * up)
        assert isinstance(out, torch.Tensor)  # down_proj has no output split
        return out

    def add_to(self, residual: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """`residual + self(x)`, as `GatedMLP.add_to` (which a decoder layer calls); the FP8
        product is not accumulated in place."""
        return residual + self(x)


def quantize_model(model: nn.Module, method: str, device: torch.device) -> int:
    """Swap, in place, the linears (and fused projections) inside `model`'s layer stacks for
    `method`'s quantized ones; returns how many were swapped. FP8 leaves a linear whose
    dimensions are not multiples of 16 as it is (torch._scaled_mm cannot take it). Int8 keeps
    each linear's loudest input channel in float32, found by one calibration forward
    (`int8.input_amax`)."""
    found = list(_stack_linears(model))
    outliers: list[list[int]] = [[] for _ in found]
    if method == "int8" and found:
        count = INT8_OUTLIERS if full_range_exact(default_int8_kernel()) else INT8_OUTLIERS_7BIT
        try:
            amax = input_amax(
                model,
                [child for _, _, child in found],
                int(getattr(model, "vocab_size")),  # noqa: B009 - every PoolingModel has them
                int(getattr(model, "max_positions")),  # noqa: B009
            )
        except (RuntimeError, TypeError, ValueError, IndexError) as err:
            # A forward the calibration cannot drive from token ids alone: every channel int8.
            logger.warning("int8: no calibration forward (%s); no channel kept in float32", err)
            amax = [torch.zeros(0) for _ in found]
        outliers = [
            a.topk(min(count, a.numel())).indices.tolist() if a.numel() else [] for a in amax
        ]
    swapped = 0
    for (parent, name, child), outlier in zip(found, outliers, strict=True):
        sizes = child.sizes if isinstance(child, FusedProjections) else None
        weight, bias = child.weight, child.bias
        if method == "fp8":
            if weight.shape[0] % _FP8_ALIGN or weight.shape[1] % _FP8_ALIGN:
                continue
            setattr(parent, name, Fp8Linear.from_weight(weight, bias, sizes))
        else:
            setattr(parent, name, Int8Linear(weight, bias, sizes, outliers=outlier))
        swapped += 1
    if method == "fp8":
        finish_fp8(model, device)
    return swapped


def _stack_linears(
    model: nn.Module,
) -> Iterator[tuple[nn.Module, str, nn.Linear | FusedProjections]]:
    """(parent, attribute, module) of every linear and fused projection inside a layer of a
    `ModuleList` (the repeated layers; heads and embeddings sit outside them)."""
    seen: set[int] = set()
    for stack in model.modules():
        if not isinstance(stack, nn.ModuleList):
            continue
        for layer in stack:
            for parent in layer.modules():
                for name, child in parent.named_children():
                    if isinstance(child, (nn.Linear, FusedProjections)) and id(child) not in seen:
                        seen.add(id(child))
                        yield parent, name, child


def finish_fp8(model: nn.Module, device: torch.device) -> None:
    """Once FP8 linears are in place (quantized here or loaded, per channel or in blocks):
    scales per channel, the kernels and the FP8 matmul chosen for `device`, and each pre-norm
    decoder layer's norms folded into the projections they feed."""
    capable = device.type == "cuda" and torch.cuda.get_device_capability(device) >= (
        FP8_MIN_CAPABILITY
    )
    kernels = fused_fp8_ops(device)
    if kernels:
        import vecpool.models.quant.fp8_ops  # noqa: F401 - registers the ops
    for module in model.modules():
        if isinstance(module, Fp8BlockLinear):
            module.choose_backend(device, kernels)
        if isinstance(module, Fp8Linear):
            module.finish_scales()
            module.kernels = kernels
            aligned = not (module.in_features % _FP8_ALIGN or module.out_features % _FP8_ALIGN)
            module.scaled_mm = capable and aligned
    for stack in [m for m in model.modules() if isinstance(m, nn.ModuleList)]:
        layers = [
            m
            for m in stack
            if isinstance(m, DecoderLayer) and type(m).forward is DecoderLayer.forward
        ]
        folded = [_fold_decoder_norms(layer) for layer in layers]
        # A whole stack of plain pre-norm layers, both norms of each folded.
        whole = layers and len(layers) == len(stack) and all(folded)
        if SUM_IN_NORM and whole and all(type(layer) is DecoderLayer for layer in layers):
            for layer in layers:
                layer.__class__ = SumInNormLayer
            setattr(layers[-1], "hands_on_sum", False)  # noqa: B010


def _fold_decoder_norms(layer: DecoderLayer) -> bool:
    """In a pre-norm layer (`x + attn(norm1(x))`, `x + mlp(norm2(x))`) each norm's output
    feeds one projection only: compute it there, emitting FP8 rows, and leave an identity.
    Whether both norms were folded."""
    attn, mlp = layer.self_attn, layer.mlp
    norm1, norm2 = layer.input_layernorm, layer.post_attention_layernorm
    if isinstance(attn.qkv_proj, (Fp8Linear, Fp8BlockLinear)) and isinstance(norm1, RMSNorm):
        setattr(attn, "qkv_proj", Fp8NormLinear(norm1, attn.qkv_proj))  # noqa: B010
        setattr(layer, "input_layernorm", nn.Identity())  # noqa: B010
    if isinstance(mlp, GatedMLP) and any(
        isinstance(mlp.gate_up_proj, kind) and isinstance(mlp.down_proj, kind)
        for kind in (Fp8Linear, Fp8BlockLinear)
    ):
        folded = isinstance(norm2, RMSNorm)
        fp8_mlp = Fp8GatedMLP(
            mlp.gate_up_proj,  # type: ignore[arg-type]  # checked just above
            mlp.down_proj,  # type: ignore[arg-type]
            mlp.act,
            norm2 if folded else None,
        )
        setattr(layer, "mlp", fp8_mlp)  # noqa: B010
        if folded:
            setattr(layer, "post_attention_layernorm", nn.Identity())  # noqa: B010
    return isinstance(layer.self_attn.qkv_proj, Fp8NormLinear) and isinstance(
        getattr(layer.mlp, "gate_up_proj", None), Fp8NormLinear
    )


def has_fp8_layers(model: nn.Module) -> bool:
    """Whether `model` multiplies in FP8 anywhere (quantized here or stored so)."""
    return any(isinstance(m, (Fp8Linear, Fp8BlockLinear)) for m in model.modules())


def restore_fp8_dtypes(model: nn.Module) -> None:
    """After `model.to(dtype)` on the meta device (which casts every floating tensor): give
    the FP8 linears back their FP8 weights and float32 scales (each class's `PARAM_DTYPES`)."""
    for module in model.modules():
        for name, dtype in getattr(module, "PARAM_DTYPES", {}).items():
            param: nn.Parameter | None = getattr(module, name)
            if param is not None and param.dtype != dtype:
                setattr(module, name, nn.Parameter(param.to(dtype), requires_grad=False))
