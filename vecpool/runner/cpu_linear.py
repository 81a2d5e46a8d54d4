"""Linears of the layer stack on the CPU, through oneDNN with prepacked weights.

On the CPU a plain `F.linear` goes to the BLAS library's GEMM, which re-lays out the weight on
every call and adds the bias in a second pass over the output. oneDNN takes the weight once, in
its own blocked layout for this CPU's vector width, and adds the bias inside the kernel. On a
2-core avx512 machine this makes MiniLM's linears 1.2-2x faster at every step size (8 to 4,096
rows), which is most of a CPU step's time.

Every linear of the model's repeated blocks is replaced by a `PackedLinear` holding the same
weight and bias (still readable, as parameters) and its packed copy; a fused projection keeps
returning its parts. A model whose layers call `layers.linear_activation` / `linear_residual`
gets the activation (gelu, relu) or the residual add applied inside the kernel, as oneDNN
post-ops, while the output is still in cache: one pass over memory less each. Both an input given as ids and as embeds run the same packed kernels, so
they stay bit-exact; against the plain GEMM the sums run in another order (float32: relative
differences around 1e-6).
"""

from __future__ import annotations

import torch
from torch import nn

from vecpool.models.layers.basic import FusedProjections
from vecpool.runner.compiled import repeated_blocks

# Dtypes oneDNN's CPU linear serves (bfloat16 needs avx512_bf16 or AMX to be fast).
PACKED_DTYPES = (torch.float32, torch.bfloat16)

# Activations oneDNN applies to a linear's output inside the kernel, by `activation_name`:
# (post-op, algorithm). Exact gelu (erf) and relu give the same bits as torch's own
# functions; the tanh approximation differs from `F.gelu(approximate="tanh")` by an ulp or so.
FUSED_ACTIVATIONS = {
    "gelu": ("gelu", "none"),
    "gelu_new": ("gelu", "tanh"),
    "gelu_pytorch_tanh": ("gelu", "tanh"),
    "gelu_fast": ("gelu", "tanh"),
    "relu": ("relu", ""),
}


class PackedLinear(nn.Module):
    """`x @ weight.T + bias` through oneDNN with the weight prepacked once; with `sizes`, the
    output split along its last dimension (a `FusedProjections`' parts)."""

    def __init__(
        self, weight: torch.Tensor, bias: torch.Tensor | None, sizes: list[int] | None = None
    ):
        super().__init__()
        self.weight = nn.Parameter(weight.detach(), requires_grad=False)  # [out, in]
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)
        self.sizes = sizes
        # oneDNN's opaque blocked layout of `weight`: not a parameter, never saved or moved.
        self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight, None)

    def forward(self, x: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, ...]:
        out = self._pointwise(x, "none", "")
        if self.sizes is not None:
            return out.split(self.sizes, dim=-1)
        return out

    def fused_activation(self, x: torch.Tensor, act: str) -> torch.Tensor | None:
        """`act(x @ weight.T + bias)` in one kernel; None if oneDNN has no such post-op."""
        post = FUSED_ACTIVATIONS.get(act)
        if post is None or self.sizes is not None:
            return None
        return self._pointwise(x, *post)

    def fused_add(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """`x @ weight.T + bias + residual` in one kernel (the same bits as adding after)."""
        assert self.sizes is None, "a fused projection returns parts, not one sum"
        rows = _rows(x)
        other = _rows(residual)
        out = torch.ops.mkldnn._linear_pointwise.binary(rows, other, self.packed, self.bias, "add")
        return out.view(*x.shape[:-1], out.shape[-1])

    def _pointwise(self, x: torch.Tensor, post: str, algorithm: str) -> torch.Tensor:
        out = torch.ops.mkldnn._linear_pointwise(
            _rows(x), self.packed, self.bias, post, [], algorithm
        )
        return out.view(*x.shape[:-1], out.shape[-1])


def _rows(x: torch.Tensor) -> torch.Tensor:
    """`x` as a contiguous `[rows, features]` matrix (a view when it already is one)."""
    rows = x.reshape(-1, x.shape[-1])
    return rows if rows.is_contiguous() else rows.contiguous()


def can_pack(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether linears on `device` in `dtype` can run through oneDNN's packed kernel (its
    bfloat16 path needs AVX-512 or newer: elsewhere bfloat16 linears stay `nn.Linear`)."""
    return (
        device.type == "cpu"
        and dtype in PACKED_DTYPES
        and torch.backends.mkldnn.is_available()
        and (dtype != torch.bfloat16 or bool(torch.ops.mkldnn._is_mkldnn_bf16_supported()))
    )


def pack_linears(model: nn.Module) -> int:
    """Replace every `nn.Linear` and `FusedProjections` inside the model's repeated blocks by a
    `PackedLinear` with the same parameters. Returns how many were replaced."""
    count = 0
    for block in repeated_blocks(model):
        for parent in list(block.modules()):
            for name, child in list(parent.named_children()):
                # Exact types: a subclass computes its product its own way (batch-invariant).
                if type(child) is nn.Linear:
                    setattr(parent, name, PackedLinear(child.weight, child.bias))
                elif type(child) is FusedProjections:
                    setattr(parent, name, PackedLinear(child.weight, child.bias, child.sizes))
                else:
                    continue
                count += 1
    return count
