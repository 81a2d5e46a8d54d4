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
post-ops, while the output is still in cache: one pass over memory less each. Against the
plain GEMM the sums run in another order (float32: relative differences around 1e-6).

oneDNN's kernels also compute every output row from its own input row alone, in one order for
every row of a product: they tile the rows and walk K in the same order in each tile (only a
product of a single row may take a kernel of its own). MKL's GEMM does not promise it, and on
Intel AVX-512 CPUs it does not: a product with one to three output columns (a classifier's
labels, a reranker's score, BGE-M3's token weight) computes some rows with other kernels than
their neighbours, and a product of fewer than 16 rows others than a larger one; capped at AVX2
(`MKL_ENABLE_INSTRUCTIONS`), its tails of six rows do too. So the task heads on the CPU run
their products here as well (`RowwiseHead`): an input given as prompt embeds and the same input
given as ids get the same bits wherever they sit in one step. What this does not cover: an
activation that no linear applies inside its kernel (a gated MLP's silu or gelu, on the gate
half) runs torch's elementwise kernel, which with several threads computes the last elements
of a thread's range by scalar code; a row that such a range ends inside can then round
otherwise (the batch-invariant mode pads those functions, `invariant.piecewise`).
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from vecpool.models.layers.basic import FusedProjections
from vecpool.models.layers.invariant import InvariantFunctions
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
    return device.type == "cpu" and _onednn_serves(dtype)


@functools.cache
def _onednn_serves(dtype: torch.dtype) -> bool:
    """Whether oneDNN's CPU linear serves `dtype` on this CPU (asked once per dtype)."""
    return (
        dtype in PACKED_DTYPES
        and torch.backends.mkldnn.is_available()
        and (dtype != torch.bfloat16 or bool(torch.ops.mkldnn._is_mkldnn_bf16_supported()))
    )


def onednn_linear(
    x: torch.Tensor,  # [..., K]
    weight: torch.Tensor,  # [N, K]
    bias: torch.Tensor | None = None,  # [N]
) -> torch.Tensor:  # [..., N]
    """`F.linear` through oneDNN's kernel, the weight laid out for this call (a head's weights
    are small, or used once a step): every output row computed from its input row alone, the
    same way at any position among the rows. Where oneDNN does not serve the tensors (another
    device or dtype, or mixed dtypes) it is `F.linear`."""
    if not (
        x.device.type == "cpu"
        and _onednn_serves(x.dtype)
        and weight.dtype == x.dtype
        and (bias is None or bias.dtype == x.dtype)
    ):
        return F.linear(x, weight, bias)
    out = torch.ops.mkldnn._linear_pointwise(_rows(x), weight.contiguous(), bias, "none", [], "")
    return out.view(*x.shape[:-1], out.shape[-1])


class RowwiseFunctions(InvariantFunctions):
    """While active: `F.linear` runs `onednn_linear`, and the transcendental elementwise
    functions (activations) run `piecewise` (every element by torch's vector code: its scalar
    code, which rounds otherwise, takes the elements left at the end of a thread's range,
    wherever that falls among the rows)."""

    def __torch_function__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        if func is F.linear:
            return onednn_linear(*args, **(kwargs or {}))
        return super().__torch_function__(func, types, args, kwargs)


class RowwiseHead:
    """A task head on the CPU run under `RowwiseFunctions`: each of its output rows depends on
    that row's input alone, not on where in the step the row sits (the heads' products,
    `[num_seqs, hidden]` rows through a classifier, a projection or the vocabulary, and their
    activations). Across steps of other sizes the sums may still differ by an ulp or so."""

    def __init__(self, head: Any):
        self.head = head
        self.per_token: bool = head.per_token
        self.needs_token_ids: bool = head.needs_token_ids
        self.prefix_carry: tuple[str, ...] | None = head.prefix_carry

    def __call__(self, b: Any, /) -> list[np.ndarray | None]:
        with RowwiseFunctions():
            out: list[np.ndarray | None] = self.head(b)
        return out


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
