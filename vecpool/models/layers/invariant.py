"""The batch-invariant mode: a row's result does not depend on the other rows of its step.

Where the normal mode is not invariant, and what replaces it (`Engine(batch_invariant=True)`):
- Matrix products. A vendor matmul picks its kernel, blocking and split of the reduction from
  the shape, M (the rows) included: on the CPU, MKL computes a float32 product of one to three
  rows with other kernels than a product of more; on CUDA, cuBLAS splits K when M is small.
  Here: on the CPU (and on CUDA without Triton) the rows are padded to whole `CPU_ROW_TILE`s and
  run as a batch of `[TILE, K] x [K, N]` products (`torch.bmm`, the weight at stride 0); on CUDA
  a Triton kernel with fixed blocks and no split of K (each output block is one program that
  walks K in order). `make_batch_invariant` switches a model's linear layers at build.
- Attention. The padded CPU fallback's fused kernel sizes its blocks from the step's longest
  sequence; `padded_attention` uses two fixed product shapes and adds key blocks in order (a
  block past a sequence's keys adds exact zeros). The CUDA varlen kernel is per sequence already.
- CPU elementwise functions. torch computes most elements with vector code and those left at
  the end of a thread's range with scalar code, whose exp / erf / tanh / cos / sin round
  differently; `piecewise` pads so that no element is left over. `InvariantFunctions` routes
  them (and `F.linear`) while a CPU forward or any task head runs. On CUDA an elementwise
  kernel computes every element with the same code.
- Norms and softmax reduce along one row, pooling along one sequence in order (segment sums):
  the same in any batch already.
`torch.compile` (CUDA) stays on: the products are one opaque operator in the compiled graph,
and what the compiler fuses around them is per row. CUDA graphs stay on too: a replay runs the
same kernels on padded rows, and every kernel computes a row from that row alone.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from vecpool.models.layers.basic import FusedProjections

# Rows of one tile on the CPU path: small enough that padding a step costs little, large enough
# that each product is a real matrix product (MKL's kernels for one to three rows differ).
CPU_ROW_TILE = 64
# The Triton kernel's launch: blocks (M, N, K), the group of M blocks that share weight blocks, warps,
# pipeline stages, and whether the weight's tile is read along K (its rows, as stored) and
# transposed in registers rather than read across them. Fixed: no launch depends on M.
TRITON_CONFIG: dict[str, int | bool] = dict(
    BLOCK_M=128,
    BLOCK_N=128,
    BLOCK_K=64,
    GROUP_M=8,
    num_warps=8,
    num_stages=3,
    W_ROWS=False,
)


def tiled_linear(
    x: torch.Tensor,  # [M, K]
    weight: torch.Tensor,  # [N, K]
    bias: torch.Tensor | None = None,  # [N]
    tile: int = CPU_ROW_TILE,
) -> torch.Tensor:  # [M, N]
    """`F.linear` on `[tile, K]` row tiles: the rows padded with zeros to a multiple of `tile`,
    one product call per tile. Not one batched product over the tiles: how MKL shares a batch
    among its threads depends on the number of tiles, and with it a row's summation order."""
    m = x.shape[0]
    n = weight.shape[0]
    tiles = -(-m // tile) if m else 0
    padded = F.pad(x, (0, 0, 0, tiles * tile - m))
    out = padded.new_empty((tiles * tile, n))
    w = weight.t()
    for start in range(0, tiles * tile, tile):
        rows = padded[start : start + tile]
        if bias is None:
            torch.mm(rows, w, out=out[start : start + tile])
        else:
            torch.addmm(bias, rows, w, out=out[start : start + tile])
    return out[:m]


def tiled_matmul(a: torch.Tensor, b: torch.Tensor, invariant: bool = True) -> torch.Tensor:
    """`torch.matmul(a, b)` (`a`: `[..., M, K]`, `b`: `[..., K, N]`, broadcast) whose rows do not
    depend on M when `invariant`: `a`'s rows padded to whole `CPU_ROW_TILE`s, every product
    `[CPU_ROW_TILE, K] x [K, N]`. For a model's own products over the padded layout (DeBERTa's
    relative-position terms); `invariant` False is the plain product."""
    if not invariant:
        return torch.matmul(a, b)
    m, k = a.shape[-2:]
    tiles = -(-m // CPU_ROW_TILE)
    padded = F.pad(a, (0, 0, 0, tiles * CPU_ROW_TILE - m))
    out = torch.matmul(padded.reshape(*a.shape[:-2], tiles, CPU_ROW_TILE, k), b.unsqueeze(-3))
    return out.reshape(*out.shape[:-3], tiles * CPU_ROW_TILE, out.shape[-1])[..., :m, :]


@functools.cache
def _triton_kernel() -> Any | None:
    """The Triton matmul kernel, or None where Triton is not installed (imported on first use)."""
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None

    @triton.jit
    def kernel(  # type: ignore[no-untyped-def]  # runs on CUDA or Triton's interpreter
        x_ptr,
        w_ptr,
        b_ptr,
        out_ptr,
        M,
        N,
        K: tl.constexpr,
        stride_xm,
        stride_xk,
        stride_wn,
        stride_wk,
        stride_om,
        stride_on,
        HAS_BIAS: tl.constexpr,
        IEEE: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        GROUP_M: tl.constexpr,
        W_ROWS: tl.constexpr,
    ):
        # Grouped block order (neighbouring programs share weight blocks in L2); the order in
        # which blocks run does not change any block's sums.
        pid = tl.program_id(0)
        num_m = tl.cdiv(M, BLOCK_M)
        num_n = tl.cdiv(N, BLOCK_N)
        group = GROUP_M * num_n
        first_m = (pid // group) * GROUP_M
        group_m = min(num_m - first_m, GROUP_M)
        pid_m = first_m + (pid % group) % group_m
        pid_n = (pid % group) // group_m
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):  # K is a constant of the layer: one order for every M
            kk = k0 + rk
            a = tl.load(
                x_ptr + rm[:, None] * stride_xm + kk[None, :] * stride_xk,
                mask=(rm[:, None] < M) & (kk[None, :] < K),
                other=0.0,
            )
            if W_ROWS:  # [BLOCK_N, BLOCK_K] along the weight's rows, then transposed
                b = tl.trans(
                    tl.load(
                        w_ptr + rn[:, None] * stride_wn + kk[None, :] * stride_wk,
                        mask=(rn[:, None] < N) & (kk[None, :] < K),
                        other=0.0,
                    )
                )
            else:
                b = tl.load(
                    w_ptr + rn[None, :] * stride_wn + kk[:, None] * stride_wk,
                    mask=(rn[None, :] < N) & (kk[:, None] < K),
                    other=0.0,
                )
            if IEEE:  # noqa: SIM108 - float32 inputs: full precision, as cuBLAS by default
                acc = tl.dot(a, b, acc, input_precision="ieee")
            else:
                acc = tl.dot(a, b, acc)
        if HAS_BIAS:
            acc += tl.load(b_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
        tl.store(
            out_ptr + rm[:, None] * stride_om + rn[None, :] * stride_on,
            acc.to(out_ptr.dtype.element_ty),
            mask=(rm[:, None] < M) & (rn[None, :] < N),
        )

    def launch(
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        config: dict[str, int | bool] | None = None,  # None: `TRITON_CONFIG`
    ) -> torch.Tensor:
        config = TRITON_CONFIG if config is None else config
        m, k = x.shape
        n = weight.shape[0]
        out = x.new_empty((m, n))
        grid = (triton.cdiv(m, config["BLOCK_M"]) * triton.cdiv(n, config["BLOCK_N"]),)
        kernel[grid](
            x,
            weight,
            bias if bias is not None else x,
            out,
            m,
            n,
            k,
            x.stride(0),
            x.stride(1),
            weight.stride(0),
            weight.stride(1),
            out.stride(0),
            out.stride(1),
            HAS_BIAS=bias is not None,
            IEEE=x.dtype == torch.float32,
            **config,
        )
        return out

    return launch


def triton_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    config: dict[str, int | bool] | None = None,  # the launch; None: `TRITON_CONFIG`
) -> torch.Tensor:
    """`F.linear` of `[M, K]` rows by the fixed-block Triton kernel (float32 sums, the result
    in `x`'s dtype). Raises `RuntimeError` where Triton is not installed."""
    launch = _triton_kernel()
    if launch is None:
        raise RuntimeError("the Triton matmul needs the triton package")
    out: torch.Tensor = launch(x, weight, bias, config)
    return out


@torch.library.custom_op("vecpool::invariant_linear", mutates_args=())
def _invariant_linear_op(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """One opaque operator for `torch.compile`: the compiled graph calls it as it is."""
    if x.device.type == "cuda" and _triton_kernel() is not None:
        return triton_linear(x.contiguous(), weight, bias)
    return tiled_linear(x, weight, bias)


@_invariant_linear_op.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty((x.shape[0], weight.shape[0]))


def invariant_linear(
    x: torch.Tensor,  # [..., K]
    weight: torch.Tensor,  # [N, K]
    bias: torch.Tensor | None = None,  # [N]
) -> torch.Tensor:  # [..., N]
    """`F.linear` whose every output row depends on its input row and the weights only."""
    rows = x.reshape(-1, x.shape[-1])
    out = _invariant_linear_op(rows, weight, bias)
    return out.view(*x.shape[:-1], weight.shape[0])


class InvariantLinear(nn.Linear):
    """An `nn.Linear` computed by `invariant_linear` (set by `make_batch_invariant`)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return invariant_linear(x, self.weight, self.bias)


class InvariantFusedProjections(FusedProjections):
    """`FusedProjections` computed by `invariant_linear` (set by `make_batch_invariant`)."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return invariant_linear(x, self.weight, self.bias).split(self.sizes, dim=-1)


_SWAPS: dict[type[nn.Module], type[nn.Module]] = {
    nn.Linear: InvariantLinear,
    FusedProjections: InvariantFusedProjections,
}


def make_batch_invariant(module: nn.Module) -> int:
    """Switch every linear layer of `module` (`nn.Linear`, `FusedProjections`; their exact
    classes, not subclasses that compute otherwise) to the batch-invariant products, in place.
    Returns how many were switched. Done once, after the weights are loaded and fused."""
    switched = 0
    for sub in module.modules():
        swap = _SWAPS.get(type(sub))
        if swap is not None:
            sub.__class__ = swap
            switched += 1
    return switched


# Keys (and query rows) of one block of the invariant attention.
KEY_BLOCK = 64


def padded_attention(
    q: torch.Tensor,  # [B, H, Lq, D]
    k: torch.Tensor,  # [B, H, Lk, D] (grouped heads already repeated)
    v: torch.Tensor,  # [B, H, Lk, D]
    mask: torch.Tensor,  # [B, 1, Lq, Lk] bool: True where a query attends to a key
    *,
    scale: float,
    softcap: float | None = None,
    bias: torch.Tensor | None = None,  # [1 or B, H, Lq, Lk], added to the scaled logits
) -> torch.Tensor:  # [B, H, Lq, D], in q's dtype
    """Attention over the padded layout whose every row is the same whatever `Lq` and `Lk`
    are (the longest sequence of the step), in float32.

    A fused kernel sizes its blocks and its reduction over keys from `Lk`; here queries and
    keys are padded to whole `KEY_BLOCK`s and every product has one of two fixed shapes,
    `[KEY_BLOCK, D] x [D, KEY_BLOCK]` and `[KEY_BLOCK, KEY_BLOCK] x [KEY_BLOCK, D]`. The row
    maximum is exact in any order; the exponentials' sums and the weighted values add up
    block by block from the first key on, and a block past a sequence's keys adds exact zeros,
    so a sequence's rows do not change with the padding the rest of the step needs."""
    b, h, lq, d = q.shape
    lk = k.shape[2]
    pq, pk = -lq % KEY_BLOCK, -lk % KEY_BLOCK
    nq, nk = (lq + pq) // KEY_BLOCK, (lk + pk) // KEY_BLOCK
    # [b, h, query blocks, KEY_BLOCK, d] and [b, h, key blocks, KEY_BLOCK, d]
    qt = F.pad(q.float(), (0, 0, 0, pq)).reshape(b, h, nq, KEY_BLOCK, d)
    kt = F.pad(k.float(), (0, 0, 0, pk)).reshape(b, h, nk, KEY_BLOCK, d)
    vt = F.pad(v.float(), (0, 0, 0, pk)).reshape(b, h, nk, KEY_BLOCK, d)
    # [b, 1, query blocks, KEY_BLOCK, key blocks, KEY_BLOCK]: True where a key is not attended
    drop = ~F.pad(mask, (0, pk, 0, pq)).reshape(b, 1, nq, KEY_BLOCK, nk, KEY_BLOCK)
    if bias is not None:
        bias = F.pad(bias.float(), (0, pk, 0, pq))
        bias = bias.reshape(bias.shape[0], h, nq, KEY_BLOCK, nk, KEY_BLOCK)
    # On the CPU, exponentials and tanh whose rounding does not depend on the tensor's size.
    exp, tanh = torch.exp, torch.tanh
    if q.device.type == "cpu":
        exp, tanh = functools.partial(piecewise, exp), functools.partial(piecewise, tanh)
    blocks: list[torch.Tensor] = []  # per key block [b, h, nq, KEY_BLOCK, KEY_BLOCK]
    for j in range(nk):
        s = torch.matmul(qt, kt[:, :, j, None].transpose(-1, -2)) * scale
        if softcap is not None:
            s = tanh(s / softcap) * softcap
        if bias is not None:
            s = s + bias[..., j, :]
        blocks.append(s.masked_fill(drop[..., j, :], float("-inf")))
    top = torch.stack([s.amax(dim=-1) for s in blocks]).amax(dim=0)  # [b, h, nq, KEY_BLOCK]
    top = top.masked_fill(torch.isinf(top), 0.0)  # rows that attend to nothing: added rows
    total = torch.zeros_like(top)
    out = qt.new_zeros((b, h, nq, KEY_BLOCK, d))
    for j, s in enumerate(blocks):
        p = exp(s - top[..., None])
        total = total + p.sum(dim=-1)
        out = out + torch.matmul(p, vt[:, :, j, None])
    out = out / total.clamp_min(torch.finfo(torch.float32).tiny)[..., None]
    return out.view(b, h, lq + pq, d)[:, :, :lq].to(q.dtype)


# torch's grain: a CPU elementwise function splits its elements between threads in chunks of
# at least this many, equal but for the last.
_GRAIN = 1 << 15


def piecewise(
    fn: Callable[..., torch.Tensor], x: torch.Tensor, *args: Any, **kwargs: Any
) -> torch.Tensor:
    """`fn(x, ...)`, an elementwise function, with every element computed by the same code.

    On the CPU torch computes an elementwise function with vector instructions, and the few
    elements left at the end of a thread's range with scalar code, whose exponentials, erf,
    tanh, cos and sin round differently in the last bit; where a range ends depends on the
    tensor's size, so on the batch. Here the flat elements are padded so that every thread's
    range is a whole number of 1,024-element runs: `p` pieces of 2 x `_GRAIN` split into
    min(threads, 2p) ranges of `_GRAIN`'s multiples when the thread count divides 1,024 p
    (`p` is rounded up until it does), so no element is left to the scalar code."""
    flat = x.reshape(-1)
    n = flat.numel()
    pieces = max(1, -(-n // (2 * _GRAIN)))
    threads = torch.get_num_threads()
    if 2 * pieces >= threads:  # else each of the 2p threads takes one grain
        step = threads // math.gcd(threads, 1024)
        pieces = -(-pieces // step) * step
    out = fn(F.pad(flat, (0, pieces * 2 * _GRAIN - n)), *args, **kwargs)
    return out[:n].view(x.shape)


# Elementwise functions whose vector and scalar code differ (exactly rounded ones need nothing).
_TRANSCENDENTAL = frozenset(
    {
        F.gelu,
        F.silu,
        torch.exp,
        torch.tanh,
        torch.sigmoid,
        torch.erf,
        torch.cos,
        torch.sin,
        torch.Tensor.exp,
        torch.Tensor.tanh,
        torch.Tensor.sigmoid,
        torch.Tensor.erf,
        torch.Tensor.cos,
        torch.Tensor.sin,
    }
)


def _row_l2(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether a `Tensor.norm` call is the L2 norm of each row of a matrix (the heads'
    normalization: `x.norm(dim=1, keepdim=True)`)."""
    if len(args) != 1 or not isinstance(args[0], torch.Tensor) or args[0].dim() != 2:
        return False
    # `Tensor.norm` hands its defaults on: p="fro" (over one dimension, the L2 norm), dtype=None.
    return (
        kwargs.get("p", 2) in (2, "fro")
        and kwargs.get("dim") in (1, -1, (1,), (-1,), [1], [-1])
        and kwargs.get("dtype") is None
    )


def row_l2_norm(x: torch.Tensor, *, keepdim: bool = False) -> torch.Tensor:
    """`x.norm(dim=1)` of `[n, d]` rows whose every value depends on its row only. On CUDA,
    where a reduction kernel's order may change with the number of rows, the sum of squares is
    a product with a column of ones through `invariant_linear` (one order for every n)."""
    if x.device.type == "cuda":
        norms = invariant_linear(x * x, x.new_ones((1, x.shape[1]))).sqrt()  # [n, 1]
    else:  # the CPU's reduction sums each row on its own, in one order, whatever n is
        norms = x.norm(dim=1, keepdim=True)
    return norms if keepdim else norms[:, 0]


class InvariantFunctions(TorchFunctionMode):
    """While active: `F.linear` runs as `invariant_linear`, and on the CPU the transcendental
    elementwise functions (activations, rotary cos / sin, the attention's exponentials) run
    `piecewise`. Used around a CPU engine's forward and around every task head."""

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if func is F.linear:
            return invariant_linear(*args, **kwargs)
        if func is torch.Tensor.norm and _row_l2(args, kwargs):
            return row_l2_norm(args[0], keepdim=bool(kwargs.get("keepdim", False)))
        if (
            func in _TRANSCENDENTAL
            and args
            and isinstance(args[0], torch.Tensor)
            and args[0].device.type == "cpu"
            and "out" not in kwargs
        ):
            return piecewise(func, *args, **kwargs)
        return func(*args, **kwargs)


class InvariantHead:
    """A task head run under `InvariantFunctions`: the heads' products and activations
    (`[num_seqs, hidden]` rows through a classifier, the vocabulary, Dense projections) take
    as many rows as the step has sequences of that task."""

    def __init__(self, head: Any):
        self.head = head
        self.per_token: bool = head.per_token
        self.needs_token_ids: bool = head.needs_token_ids
        # Never read: the mode and shared-prefix caching are not combined (EngineArgs).
        self.prefix_carry: tuple[str, ...] | None = None

    def __call__(self, b: Any, /) -> list[np.ndarray | None]:
        with InvariantFunctions():
            out: list[np.ndarray | None] = self.head(b)
        return out
