"""Int8 linears of the layer stack on the CPU: int8 weights, one scale per output channel;
uint8 rows, one scale and one offset per row, computed as the rows come; a few loud input
channels in float32.

A row `x` is stored as `q * scale + low`, `low` and `scale` its least value and its range over
255 (`quantize.quantize_rows_u8`): the steps span the row's own values. A GELU's output, from
-0.17 to several units, gets steps twice as fine as in the symmetric form (which spends half
of them on negative values it never takes). Rows are never scaled together, so a row's result
does not depend on the other rows of its step. BERT-family encoders carry one or two input
channels tens of times louder than the rest (all-MiniLM-L6-v2: 28 against a median of 1.8),
which would set every row's step: each linear keeps its loudest channels (`outliers`, found by
one float32 calibration forward of fixed pseudo-random ids, `input_amax`) out of the int8
product, in float32. All-MiniLM-L6-v2 over 310 texts, minimum / median cosine to float32:
symmetric int8 rows 0.988 / 0.9957, these rows 0.9953 / 0.9983, and four loud channels kept
0.9985 / 0.99958 (`linear.INT8_OUTLIERS`).

The integer product sums in int32, exactly, through FBGEMM
(`quantized.linear_with_input_q_dq_qweight_dq_output_fp32`, the rows handed over as floats
holding the integers, scale 1), times each channel's scale; where torch has no FBGEMM (arm64
builds), the same integers go through `torch._int_mm`. Then, per row:
`y * scale + low * weight_sums + loud @ outlier_weight + bias` (`weight_sums`: each channel's
dequantized weights summed, what the row's offset adds to it), the last three terms as one
product of `[low, loud, 1]` by the stacked `[weight_sums; outlier_weight; bias]`, then one
pass adding `y * scale`: two passes over the output where one per term took seven
(`benchmarks/lab/ab_cpu.py --variant int8 --variant int8_seven_pass`). On VNNI CPUs (AVX-512 VNNI)
FBGEMM multiplies with `vpdpbusd`, which sums in 32 bits. Without VNNI (AVX2, as AMD Zen 2 /
3; AVX-512 before Cascade Lake) it multiplies with `vpmaddubsw`, which adds each pair of
uint8 x int8 products in 16 bits, saturating: 255 * 127 * 2 does not fit. So the kernel is
asked once (`full_range_exact`) and, where it saturates, the rows get 7 bits (0..127, and
127 * 127 * 2 fits), four loud channels kept likewise: 0.9971 / 0.99914 on the same texts, but
0.9977 / 0.99869 on 128 passages of random words, under the 0.999 median aimed at.
oneDNN's int8 product (`onednn.qlinear_pointwise`) is as fast as FBGEMM on VNNI but slower than
float32 without it (and saturates likewise); `torch._int_mm` is slower than float32 on both
(`benchmarks/lab/int8_kernels.py`).
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
# Where the kernel's pair sums saturate: rows of 0..SAFE_ROW_LEVELS times weights of
# +-SAFE_WEIGHT_MAX, two products of which fit 16 bits.
SAFE_WEIGHT_MAX, SAFE_ROW_LEVELS = 127, 127
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
        outliers: list[int] | None = None,
        weight_max: int | None = None,
        row_levels: int | None = None,
    ):
        super().__init__()
        kernel = kernel or default_int8_kernel()
        if kernel not in INT8_KERNELS:
            raise ValueError(f"int8 kernel {kernel!r} is not one of {INT8_KERNELS}")
        self.out_features, self.in_features = weight.shape
        weight32 = weight.detach().float()
        # The input channels kept in float32: their columns leave the int8 weight, and each
        # row's values there leave the row before it is quantized.
        self.outliers = sorted(outliers or [])
        self._outlier_index = torch.tensor(self.outliers, dtype=torch.long)  # [C]
        # [C, N] float32: the outlier channels' weights
        self.outlier_weight = nn.Parameter(
            weight32[:, self.outliers].t().contiguous(), requires_grad=False
        )
        if self.outliers:
            weight32 = weight32.index_fill(1, self._outlier_index, 0)
        # 127, or 63 where the kernel's pair sums would saturate (`full_range_exact`)
        exact = weight_max is not None or full_range_exact(kernel)
        self.weight_max = weight_max or (127 if exact else SAFE_WEIGHT_MAX)
        self.row_levels = row_levels or (255 if exact else SAFE_ROW_LEVELS)
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
        # [2 + C, N] float32 (no bias: [1 + C, N]): what each row's offset, loud channels and
        # a one multiply, stacked, so that one small product computes the per-row terms.
        terms = [self.weight_sums[None], self.outlier_weight]
        self._epilogue = torch.cat(terms if self.bias is None else [*terms, self.bias[None]])
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
        loud = x[:, self._outlier_index].float()  # [M, C]
        # FBGEMM rounds float rows itself (to nearest, ties to even, as torch.round)
        fbgemm = self.kernel == "fbgemm"
        # The loud channels leave the rows (zeros) before they are quantized. Where the input
        # may be written (float32, no autograd), zeroed in place and given back after: M x C
        # elements each way, not a copy of the whole input.
        in_place = bool(self.outliers) and x.dtype == torch.float32 and not x.requires_grad
        if in_place:
            x.index_fill_(1, self._outlier_index, 0)
        elif self.outliers:
            x = x.index_fill(1, self._outlier_index, 0)
        try:
            rows = quantize_rows_u8(x, fbgemm, float(self.row_levels), rounded=not fbgemm)
        finally:
            if in_place:
                x.index_copy_(1, self._outlier_index, loud)
        products = self.products(rows)
        # low * weight_sums + loud @ outlier_weight + bias (+ residual) as one product of
        # [low, loud, 1] ([M, 2 + C]) by `_epilogue`, then + products * scale: two passes over
        # the output where one per term took seven. A row's terms are summed in the order
        # the BLAS kernel takes, which may differ between one row and many (float32's last
        # place of the terms); everything else is per row.
        factors = [rows.offset, loud] if self.bias is None else [rows.offset, loud, ones(x)]
        left = torch.cat(factors, dim=1)
        if residual is not None:
            out = torch.addmm(residual.reshape(products.shape).float(), left, self._epilogue)
        else:
            out = torch.mm(left, self._epilogue)
        out = out.addcmul_(products, rows.scale)
        return out.to(self.out_dtype).view(*lead, self.out_features)


def ones(x: torch.Tensor) -> torch.Tensor:  # [M, 1] float32
    """A column of ones, one per row of `x` (the bias's factor in the epilogue product)."""
    return torch.ones(x.shape[0], 1, dtype=torch.float32, device=x.device)


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
