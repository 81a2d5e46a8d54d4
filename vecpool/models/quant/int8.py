"""Int8 linears of the layer stack on the CPU: int8 weights, one scale per output channel;
uint8 rows, one scale and one offset per row, computed as the rows come.

A row `x` is stored as `q * scale + low`, `low` and `scale` its least value and its range over
255 (`quantize.quantize_rows_u8`): the 256 steps span the row's own values. A GELU's output,
which reaches -0.17 below and several units above, keeps a step half as fine again as the
symmetric form (which spends half its steps on negative values it never takes), which on
all-MiniLM-L6-v2 is the difference between a median cosine to float32 of 0.9957 and 0.9983.
Rows are never scaled together, so a row's result does not depend on the other rows of its step.

The product of the uint8 rows and the int8 weights sums in int32, exactly, through FBGEMM
(`quantized.linear_with_input_q_dq_qweight_dq_output_fp32`, the rows handed over as floats in
[0, 255] with scale 1, which FBGEMM rounds as `torch.round` does), times each channel's scale:
FBGEMM's kernels for AVX2 (no saturation: it widens to 16 bits before multiplying) and for
AVX-512 VNNI. oneDNN's int8 product (`onednn.qlinear_pointwise`) is as fast on VNNI but on an
AVX2 CPU without VNNI it is slower than float32 and saturates its 16-bit pair sums, and
`torch._int_mm` is slower than float32 on both (`benchmarks/lab/int8_kernels.py`). Where torch
has no FBGEMM (arm64 builds), the same integers go through `torch._int_mm`. Then, per row,
`y * scale + low * weight_sums + bias` (`weight_sums`: each channel's dequantized weights
summed, what the row's offset adds to it). Any kernel gives the same bits: the integer sums are
exact and the rest is the same elementwise float32 arithmetic.
"""

from __future__ import annotations

import functools
import itertools
import warnings
from collections.abc import Callable

import torch
from torch import nn

from vecpool.models.quant.quantize import OffsetRows, quantize_rows, quantize_rows_u8

# The integer products' kernels, by name: "fbgemm" where torch was built with it, else
# "int_mm" (torch._int_mm on the rows shifted to int8).
INT8_KERNELS = ("fbgemm", "int_mm")
# The token counts of the calibration forward's sequences (`input_amax`).
CALIBRATION_LENGTHS = (16, 64, 128, 128)


@functools.cache
def default_int8_kernel() -> str:
    """FBGEMM where this torch has it (x86-64 builds), else `torch._int_mm`."""
    return "fbgemm" if "fbgemm" in torch.backends.quantized.supported_engines else "int_mm"


@functools.cache
def full_range_exact(kernel: str) -> bool:
    """Whether `kernel` sums uint8 x int8 products exactly over the whole range. Without VNNI
    (AVX2, AVX-512 before Cascade Lake) the x86 kernels multiply with `vpmaddubsw`, which adds
    each pair of products in 16 bits, saturating: 255 * 127 * 2 does not fit, 255 * 63 * 2
    does. Asked of the kernel itself, once: the largest values, whose exact sum is known."""
    layer = Int8Linear(torch.full((8, 64), 127.0), None, kernel=kernel, weight_max=127)
    data = torch.full((2, 64), 255.0)
    ones = torch.ones(2, 1)
    rows = OffsetRows(data if kernel == "fbgemm" else data.to(torch.uint8), ones, ones * 0)
    return bool(layer.products(rows).eq(255 * 127 * 64).all())


class Int8Linear(nn.Module):
    """`x @ weight.T + bias` with the weight in int8 (one float32 scale per output channel) and
    each row of `x` in uint8 (one scale and one offset per row); with `sizes`, the output split
    along its last dimension (a fused projection's parts)."""

    def __init__(
        self,
        weight: torch.Tensor,  # [N, K]
        bias: torch.Tensor | None,  # [N]
        sizes: list[int] | None = None,
        kernel: str | None = None,
        outlier: int | None = None,
        weight_max: int | None = None,
    ):
        super().__init__()
        kernel = kernel or default_int8_kernel()
        if kernel not in INT8_KERNELS:
            raise ValueError(f"int8 kernel {kernel!r} is not one of {INT8_KERNELS}")
        self.out_features, self.in_features = weight.shape
        weight32 = weight.detach().float()
        # The input channel kept in float32 (None: none): its column leaves the int8 weight,
        # and each row's value there leaves the row before it is quantized.
        self.outlier = outlier
        # [N] float32: the outlier channel's weights
        self.outlier_weight = (
            None
            if outlier is None
            else nn.Parameter(weight32[:, outlier].clone(), requires_grad=False)
        )
        if outlier is not None:
            weight32 = weight32.clone()
            weight32[:, outlier] = 0
        # 127, or 63 where the kernel's pair sums would saturate (`full_range_exact`)
        self.weight_max = weight_max or (127 if full_range_exact(kernel) else 63)
        data, scale = quantize_rows(weight32, torch.int8, float(self.weight_max))
        self.sizes = sizes
        self.out_dtype = weight.dtype
        self.kernel = kernel
        self.weight = nn.Parameter(data, requires_grad=False)  # [N, K] int8
        self.weight_scale = nn.Parameter(scale.view(-1), requires_grad=False)  # [N] float32
        # [N] float32: each channel's dequantized weights summed, times a row's offset
        self.weight_sums = nn.Parameter(
            data.float().sum(dim=1) * self.weight_scale, requires_grad=False
        )
        self.bias = (
            None if bias is None else nn.Parameter(bias.detach().float(), requires_grad=False)
        )
        # The weight laid out for the kernel, once (not parameters: never saved or moved).
        if kernel == "int_mm":
            self._weight_t = data.t().contiguous()  # [K, N] int8
            # [N] int32: (q - 128) @ w.T + 128 * sum(w) = q @ w.T, q the uint8 rows
            self._shift = data.sum(dim=1, dtype=torch.int32) * 128
        else:
            zero_points = torch.zeros(self.out_features, dtype=torch.long)
            with warnings.catch_warnings():  # torch marks its quantized tensors deprecated
                warnings.simplefilter("ignore")
                qweight = torch._make_per_channel_quantized_tensor(
                    data, self.weight_scale.double(), zero_points, 0
                )
                self._packed = torch.ops.quantized.linear_prepack(qweight, None)

    def products(self, rows: OffsetRows) -> torch.Tensor:  # [M, N] float32
        """The rows' integers times the weight's, summed exactly in int32, times each
        channel's scale."""
        if self.kernel == "int_mm":
            shifted = (rows.data.to(torch.int16) - 128).to(torch.int8)
            return (torch._int_mm(shifted, self._weight_t) + self._shift).float() * (
                self.weight_scale
            )
        # FBGEMM takes float rows and a scale, and rounds them itself: the rows are integers
        # already, so they pass unchanged.
        return torch.ops.quantized.linear_with_input_q_dq_qweight_dq_output_fp32(
            rows.data.float(), 1.0, 0, self._packed
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, ...]:
        out = self._linear(x, None)
        return out.split(self.sizes, dim=-1) if self.sizes else out

    def fused_add(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """`self(x) + residual`, the residual added in the pass that scales the rows."""
        if self.sizes is not None:
            raise ValueError("a fused projection returns parts, not one sum")
        return self._linear(x, residual)

    def _linear(self, x: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        lead = x.shape[:-1]
        x = x.reshape(-1, self.in_features)
        if self.outlier is not None:
            outlier = x[:, self.outlier : self.outlier + 1].float()  # [M, 1]
            x = x.index_fill(1, torch.tensor([self.outlier]), 0)
        rows = quantize_rows_u8(x, as_float=self.kernel == "fbgemm")
        out = self.products(rows)
        # y * scale + low * weight_sums + bias: elementwise passes, each element computed the
        # same way wherever its row sits (a BLAS rank-2 update is not: one row takes another
        # kernel than many)
        if residual is not None:
            out = torch.addcmul(residual.reshape(out.shape).float(), out, rows.scale)
        else:
            out = out.mul_(rows.scale)
        out = out.addcmul_(rows.offset, self.weight_sums)
        if self.outlier_weight is not None:
            out = out.addcmul_(outlier, self.outlier_weight)
        if self.bias is not None:
            out = out.add_(self.bias)
        return out.to(self.out_dtype).view(*lead, self.out_features)


def input_amax(
    model: nn.Module, linears: list[nn.Module], vocab_size: int, max_positions: int
) -> list[torch.Tensor]:
    """Each of `linears`' largest input magnitude per input channel (`[K]` float32), over one
    float32 forward of fixed pseudo-random token ids (`CALIBRATION_LENGTHS`, seed 0) through
    `model`, which takes a flat batch as every vecpool model does."""
    from vecpool.models.layers.attention import AttentionMetadata

    amax = [torch.zeros(0) for _ in linears]

    def record(i: int) -> Callable[[nn.Module, tuple[torch.Tensor, ...]], None]:
        def hook(module: nn.Module, args: tuple[torch.Tensor, ...]) -> None:
            x = args[0].detach().reshape(-1, args[0].shape[-1]).float().abs().amax(dim=0)
            amax[i] = x if amax[i].numel() == 0 else torch.maximum(amax[i], x)

        return hook

    lengths = [min(n, max_positions) for n in CALIBRATION_LENGTHS]
    gen = torch.Generator().manual_seed(0)
    # ids from the upper nine tenths of the vocabulary: past the special and reserved tokens
    ids = torch.randint(vocab_size // 10, vocab_size, (sum(lengths),), generator=gen)
    positions = torch.cat([torch.arange(n) for n in lengths])
    cu = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32)
    attn = AttentionMetadata(
        cu_seqlens=cu,
        max_seqlen=max(lengths),
        seq_ids=torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths)),
        pos_in_seq=positions,
        use_varlen=False,
    )
    handles = [m.register_forward_pre_hook(record(i)) for i, m in enumerate(linears)]
    try:
        with torch.inference_mode():
            model(model.embed_input_ids(ids), positions, attn)  # type: ignore[operator]
    finally:
        for handle in handles:
            handle.remove()
    return amax
