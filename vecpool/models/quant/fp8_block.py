"""Block-scaled FP8 linears: checkpoints stored as DeepSeek-V3 and the Qwen3 FP8 releases ship.

Hugging Face's fine-grained FP8 form (`quantization_config`: `quant_method` "fp8",
`weight_block_size` [bn, bk]) keeps each linear's `[N, K]` weight in float8 e4m3 with one
float32 factor per bn x bk block, `weight_scale_inv` (`[ceil(N / bn), ceil(K / bk)]`; despite
its name, what the stored values are multiplied by); compressed-tensors' "block" strategy
(llm-compressor's FP8_BLOCK) stores the same factors as `weight_scale`. Activations are
quantized as they come: one scale per token and group of bk inputs (`[M, ceil(K / bk)]`), so a
row's result never depends on the other rows of its step, and prompt embeds still give the
bits of ids.

On Hopper (compute capability 9.0), with 128 x 128 blocks and both dimensions multiples of 512,
the product runs through cuBLAS's block-scaled FP8 matmul (`torch._scaled_mm` recognizes the
scales by their shapes; it takes row counts that are multiples of 4, so a step's rows are padded
to 16). On CUDA the rows are quantized by the Triton kernels of `fp8_kernels`, fused into the
RMSNorm or SiLU * up that produces them in a pre-norm decoder, as the per-channel FP8 path
does. Other CUDA layers (other devices, blocks or widths) multiply in the model's dtype by the
weight dequantized once at load, their inputs unquantized. On the CPU the FP8 arithmetic runs
dequantized in float32 (the weight once, the inputs as they come): exact up to the float32
rounding of each value times its scale and the order of the sums, which is what the tests
check.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from vecpool.errors import ConfigError
from vecpool.models.layers.basic import RMSNorm
from vecpool.models.quant.quantize import (
    FP8_DTYPE,
    FP8_MAX,
    MIN_AMAX,
    ROW_ALIGN,
    QuantizedRows,
    bias_and_input_scale,
    cdiv,
    dequantize_groups,
    quantize_groups,
)

# The block factors' name in each form: Hugging Face's fine-grained FP8, compressed-tensors'
# "block" strategy (llm-compressor's FP8_BLOCK).
BLOCK_SCALE_NAMES = {"fp8": "weight_scale_inv", "compressed-tensors": "weight_scale"}
# What cuBLAS's block-scaled FP8 matmul takes: 128 x 128 weight blocks on compute capability 9.0.
CUBLAS_BLOCK = (128, 128)
CUBLAS_CAPABILITY = (9, 0)
# cuBLAS gets both dimensions of a weight only in multiples of this: every layer measured right
# on the H200 had them, and BERT-base's came out wrong (cosine 0.55 to bf16,
# `benchmarks/results/fp8_block_bert-base_h200.json`; not diagnosed further: the suspect is its
# 768-wide layers' rows of 6 factors, 24 bytes, which no layer measured right had).
CUBLAS_ALIGN = 512


def quantize_blocks(
    weight: torch.Tensor, block: tuple[int, int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """A `[N, K]` weight as a block-wise FP8 checkpoint stores it: (`[N, K]` FP8,
    `[ceil(N / bn), ceil(K / bk)]` float32 factors, each block's amax / 448). For tests and
    benchmarks that write such checkpoints; the engine reads them as they are."""
    (n, k), (bn, bk) = weight.shape, block
    w = F.pad(weight.float(), (0, cdiv(k, bk) * bk - k, 0, cdiv(n, bn) * bn - n))
    blocks = w.view(cdiv(n, bn), bn, cdiv(k, bk), bk)
    scale = blocks.abs().amax(dim=(1, 3), keepdim=True).clamp_(min=MIN_AMAX) / FP8_MAX
    data = (blocks / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).view_as(w)[:n, :k]
    return data.contiguous(), scale.view(cdiv(n, bn), cdiv(k, bk))


def dequantize_blocks(
    data: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]
) -> torch.Tensor:
    """The float32 `[N, K]` weight that FP8 `data` under block factors `scale` stands for."""
    (n, k), (bn, bk) = data.shape, block
    factors = scale.float().repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
    return data.float() * factors


def cublas_block_fp8(device: torch.device) -> bool:
    """Whether `device` multiplies block-scaled FP8 through cuBLAS (Hopper)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) == CUBLAS_CAPABILITY


# An opaque op to the compiler: cuBLAS reads the scales in layouts of its own, which a compiled
# graph would not otherwise keep.
@torch.library.custom_op("vecpool::fp8_block_mm", mutates_args=())
def block_mm(
    data: torch.Tensor, scale: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor
) -> torch.Tensor:
    """`[M, K]` FP8 rows with `[M, K / 128]` group scales times the `[N, K]` FP8 weight with
    `[N / 128, K / 128]` block factors -> `[M, N]` bf16 (M a multiple of 4), through cuBLAS."""
    return torch._scaled_mm(
        data,
        weight.t(),  # [K, N], column-major
        scale_a=scale.t().contiguous().t(),  # the rows adjacent ("outer-dim-major")
        scale_b=weight_scale.t(),  # [K / 128, N / 128]
        out_dtype=torch.bfloat16,
    )


@block_mm.register_fake
def _(
    data: torch.Tensor, scale: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor
) -> torch.Tensor:
    return data.new_empty((data.shape[0], weight.shape[0]), dtype=torch.bfloat16)


class Fp8BlockLinear(nn.Module):
    """A linear layer as a block-wise FP8 checkpoint stores it: `weight` `[N, K]` FP8 and one
    float32 factor per `block` (bn x bk) of it, named `scale_name` as the checkpoint names it
    (`block_scale`); inputs quantized per token and group of bk. `sizes` splits the output as
    `FusedProjections` does (q/k/v); a static `input_scale` of the checkpoint is loaded and not
    used (the rows are scaled per token and group, which is at least as fine)."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        block: tuple[int, int],
        bias: bool,
        out_dtype: torch.dtype,
        sizes: list[int] | None = None,
        input_scale_shape: tuple[int, ...] | None = None,
        scale_name: str = BLOCK_SCALE_NAMES["fp8"],
    ):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.block = block
        self.scale_name = scale_name
        # The dtypes of the parameters as loaded (`linear.restore_fp8_dtypes`).
        self.PARAM_DTYPES = {
            "weight": FP8_DTYPE,
            scale_name: torch.float32,
            "input_scale": torch.float32,
        }
        self.sizes = sizes
        self.out_dtype = out_dtype
        # [N, K] float8_e4m3fn
        self.weight = nn.Parameter(
            torch.empty(out_features, in_features, dtype=FP8_DTYPE), requires_grad=False
        )
        # [ceil(N / bn), ceil(K / bk)] float32
        self.register_parameter(
            scale_name,
            nn.Parameter(
                torch.empty(
                    cdiv(out_features, block[0]),
                    cdiv(in_features, block[1]),
                    dtype=torch.float32,
                ),
                requires_grad=False,
            ),
        )
        # [N] in out_dtype; a checkpoint's static input scale (loaded, not used)
        self.bias, self.input_scale = bias_and_input_scale(
            out_features, bias, out_dtype, input_scale_shape
        )
        # Set by `choose_backend`: the product through cuBLAS; rows quantized by the `fp8_ops`
        # group ops (Triton on CUDA); or the `[N, K]` weight dequantized once (float32 on the
        # CPU, whose inputs are still quantized: `fp8_inputs`; the model's dtype on CUDA).
        self.cublas = False
        self.kernels = False
        self.dense_weight: torch.Tensor | None = None
        self.fp8_inputs = True

    @property
    def block_scale(self) -> torch.Tensor:  # [ceil(N / bn), ceil(K / bk)] float32
        scale: torch.Tensor = getattr(self, self.scale_name)
        return scale

    def set_block_scale(self, scale: torch.Tensor) -> None:
        setattr(self, self.scale_name, nn.Parameter(scale, requires_grad=False))

    def choose_backend(self, device: torch.device, kernels: bool = False) -> None:
        """How this layer multiplies on `device`: through cuBLAS where the device and the
        layer's shapes allow it (rows quantized by the `fp8_ops` group ops when `kernels`);
        elsewhere on CUDA in the model's dtype, on the weight dequantized once; on the CPU in
        float32 on the weight dequantized once, its inputs quantized and dequantized as they
        come (the FP8 arithmetic the tests check)."""
        self.cublas = (
            cublas_block_fp8(device)
            and self.block == CUBLAS_BLOCK
            and self.in_features % CUBLAS_ALIGN == 0
            and self.out_features % CUBLAS_ALIGN == 0
        )
        self.dense_weight = None
        if not self.cublas:  # dequantized once, not at every call
            dense = dequantize_blocks(self.weight, self.block_scale, self.block)
            self.dense_weight = dense.to(self.out_dtype) if device.type == "cuda" else dense
        self.fp8_inputs = device.type != "cuda"
        self.kernels = kernels and (self.cublas or self.fp8_inputs)

    @classmethod
    def fuse_parts(cls, parts: list[nn.Module]) -> Fp8BlockLinear:
        """Layers over the same input as one (q/k/v, gate/up): weights and block factors
        stacked along the outputs, which keeps every block whole only if each part but the
        last fills whole blocks."""
        layers = [p for p in parts if isinstance(p, Fp8BlockLinear)]
        if len(layers) != len(parts):
            raise ConfigError(
                "a checkpoint stores some of the projections that share an input in block-wise "
                "FP8 and others not; they must be quantized alike"
            )
        block = layers[0].block
        for layer in layers[:-1]:
            if layer.out_features % block[0]:
                raise ConfigError(
                    f"block-wise FP8 projections of {[p.out_features for p in layers]} outputs "
                    f"in blocks of {block[0]}: each but the last must fill whole blocks to be "
                    "joined"
                )
        with torch.device("meta"):  # filled below
            fused = cls(
                layers[0].in_features,
                sum(p.out_features for p in layers),
                block=block,
                bias=False,
                out_dtype=layers[0].out_dtype,
                sizes=[p.out_features for p in layers],
                scale_name=layers[0].scale_name,
            )
        fused.weight = nn.Parameter(torch.cat([p.weight for p in layers]), requires_grad=False)
        fused.set_block_scale(torch.cat([p.block_scale.float() for p in layers]))
        biases = [p.bias for p in layers]
        if all(b is not None for b in biases):
            fused.bias = nn.Parameter(torch.cat(biases), requires_grad=False)  # type: ignore[arg-type]
        return fused

    def forward(self, x: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, ...]:
        if self.dense_weight is not None and not self.fp8_inputs:
            return self._finish(F.linear(x, self.dense_weight))
        lead = x.shape[:-1]
        rows = x.reshape(-1, self.in_features)
        if self.kernels:
            quantized = QuantizedRows(*torch.ops.vecpool.fp8_quant_groups(rows, self.block[1]))
        else:
            padding = (-rows.shape[0]) % ROW_ALIGN if self.cublas else 0
            quantized = quantize_groups(F.pad(rows, (0, 0, 0, padding)), self.block[1])
        return self._finish(self._product(quantized, rows.shape[0]).view(*lead, self.out_features))

    def norm_forward(
        self, x: torch.Tensor, norm: RMSNorm
    ) -> torch.Tensor | tuple[torch.Tensor, ...]:
        """This layer of `norm(x)` (`[M, K]` rows), on CUDA the norm writing FP8 rows and
        their group scales directly."""
        if not self.kernels:
            return self(norm(x))
        n = norm
        rows = torch.ops.vecpool.fp8_rms_norm_groups(
            x, n.weight, n.eps, n.unit_offset, self.block[1]
        )
        return self._finish(self._product(QuantizedRows(*rows), x.shape[0]))

    def add_norm_forward(
        self, residual: torch.Tensor, delta: torch.Tensor, norm: RMSNorm
    ) -> tuple[torch.Tensor, torch.Tensor | tuple[torch.Tensor, ...]]:
        """(`residual + delta`, this layer of its norm), on CUDA from one kernel that writes
        the sum, the FP8 rows and their group scales."""
        if not self.kernels:
            total = residual + delta
            return total, self.norm_forward(total, norm)
        n = norm
        total, *rows = torch.ops.vecpool.fp8_add_rms_norm_groups(
            residual, delta, n.weight, n.eps, n.unit_offset, self.block[1]
        )
        return total, self._finish(self._product(QuantizedRows(*rows), total.shape[0]))

    def silu_mul_forward(self, gate_up: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, ...]:
        """This layer of SiLU(gate) * up, which the `fp8_silu_mul_groups` op writes as FP8
        rows and group scales."""
        rows = torch.ops.vecpool.fp8_silu_mul_groups(gate_up, self.block[1])
        return self._finish(self._product(QuantizedRows(*rows), gate_up.shape[0]))

    def _finish(self, out: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, ...]:
        if self.bias is not None:
            out = out + self.bias
        return out.split(self.sizes, dim=-1) if self.sizes else out

    def _product(self, rows: QuantizedRows, m: int) -> torch.Tensor:
        """The first `m` rows (of `rows`, padded or not) times the weight: `[m, N]`."""
        if self.cublas:
            out = torch.ops.vecpool.fp8_block_mm(
                rows.data, rows.scale, self.weight, self.block_scale
            )
            return out[:m].to(self.out_dtype)
        inputs = dequantize_groups(QuantizedRows(rows.data[:m], rows.scale[:m]), self.block[1])
        weight = self.dense_weight
        if weight is None:  # a layer no backend was chosen for (built by hand)
            weight = dequantize_blocks(self.weight, self.block_scale, self.block)
        return (inputs @ weight.t()).to(self.out_dtype)
