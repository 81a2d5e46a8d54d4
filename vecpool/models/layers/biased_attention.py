"""Variable-length attention with an additive bias shared by every sequence, on CUDA.

The FlashAttention kernel behind `varlen_attn` takes no bias, so the encoders whose logits get
one per step (MPNet's and T5's relative position buckets, Jina's ALiBi: `[1, heads, L, L]`, a
function of positions only) would pay the padded fallback: a copy into `[num_seqs, max_len]`,
attention over the padding, and no CUDA graphs. This Triton kernel reads the flat batch
directly: one program per (block of a sequence's queries, sequence, head) walks that
sequence's keys only, adds `bias[0, head, i, j]` to the scaled logit of query `i` and key `j`,
and keeps FlashAttention's running softmax in float32. Each sequence's result depends on its
own rows and the bias alone, never on the step around it.

Compiled layers call it through `vecpool::biased_attention`, an op opaque to the compiler.
"""

from __future__ import annotations

import functools
import importlib.util
import math
from typing import Any

import torch

_BLOCK_M = 64  # queries per program
_BLOCK_N = 64  # keys per inner step
_MAX_HEAD_DIM = 256
# Whether Triton is installed, known without importing it (compiled layers ask too, and the
# compiler cannot trace Triton's import).
_HAS_TRITON = importlib.util.find_spec("triton") is not None


@functools.cache
def _kernel() -> Any | None:
    """The Triton kernel, built on first use; None where Triton is missing."""
    try:
        import triton
        import triton.language as tl
    except ImportError:  # pragma: no cover - `_HAS_TRITON` says so first
        return None

    @triton.jit
    def biased_attention_kernel(  # type: ignore[no-untyped-def]
        q_ptr,
        k_ptr,
        v_ptr,
        bias_ptr,
        out_ptr,
        cu_ptr,
        stride_qt,
        stride_qh,
        stride_kt,
        stride_kh,
        stride_vt,
        stride_vh,
        stride_ot,
        stride_oh,
        stride_bh,
        stride_bm,
        qk_scale,  # the logits' scale times log2(e): softmax runs in base 2
        HEAD_DIM: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_D: tl.constexpr,
    ):
        block = tl.program_id(0)
        seq = tl.program_id(1)
        head = tl.program_id(2)
        start = tl.load(cu_ptr + seq)
        length = tl.load(cu_ptr + seq + 1) - start
        if block * BLOCK_M >= length:
            return
        log2e: tl.constexpr = 1.4426950408889634
        rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = tl.arange(0, BLOCK_N)
        dims = tl.arange(0, BLOCK_D)
        row_ok = rows < length
        dim_ok = dims < HEAD_DIM
        q = tl.load(
            q_ptr + (start + rows)[:, None] * stride_qt + head * stride_qh + dims[None, :],
            mask=row_ok[:, None] & dim_ok[None, :],
            other=0.0,
        )
        bias_rows = bias_ptr + head * stride_bh + rows[:, None] * stride_bm
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        for first in range(0, length, BLOCK_N):
            keys = first + cols
            key_ok = keys < length
            kv_mask = key_ok[:, None] & dim_ok[None, :]
            k = tl.load(
                k_ptr + (start + keys)[:, None] * stride_kt + head * stride_kh + dims[None, :],
                mask=kv_mask,
                other=0.0,
            )
            bias = tl.load(
                bias_rows + keys[None, :], mask=row_ok[:, None] & key_ok[None, :], other=0.0
            )
            s = tl.dot(q, tl.trans(k)) * qk_scale + bias.to(tl.float32) * log2e
            s = tl.where(key_ok[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(
                v_ptr + (start + keys)[:, None] * stride_vt + head * stride_vh + dims[None, :],
                mask=kv_mask,
                other=0.0,
            )
            acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
            m_i = m_new
        out = acc / l_i[:, None]
        tl.store(
            out_ptr + (start + rows)[:, None] * stride_ot + head * stride_oh + dims[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=row_ok[:, None] & dim_ok[None, :],
        )

    return biased_attention_kernel


def serves(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor) -> bool:
    """Whether the kernel can run this attention: on CUDA, one bias for every sequence, as
    many key heads as query heads, a head size it takes, and Triton present."""
    return (
        q.is_cuda
        and bias.dim() == 4
        and bias.shape[0] == 1
        and k.shape[1] == q.shape[1]
        and q.shape[2] <= _MAX_HEAD_DIM
        # The kernel's offsets are 32-bit: a step past 2^31 elements of a row layout runs the
        # padded fallback instead.
        and q.shape[0] * max(q.stride(0), k.stride(0), v.stride(0)) < 2**31
        and bias.numel() < 2**31
        and _HAS_TRITON
    )


def biased_attention(
    q: torch.Tensor,  # [num_tokens, heads, head_dim], rows of head_dim values
    k: torch.Tensor,  # [num_tokens, heads, head_dim]
    v: torch.Tensor,  # [num_tokens, heads, head_dim]
    cu_seqlens: torch.Tensor,  # [num_seqs + 1] int32
    max_seqlen: int,
    bias: torch.Tensor,  # [1, heads, >= max_seqlen, >= max_seqlen]
    scale: float,
) -> torch.Tensor:  # [num_tokens, heads, head_dim]
    """Each sequence attending to itself (no causal mask), `bias[0, h, i, j]` added to the
    scaled logit of its query `i` and key `j`."""
    if torch.compiler.is_compiling():
        return torch.ops.vecpool.biased_attention(q, k, v, cu_seqlens, bias, max_seqlen, scale)
    return _launch(q, k, v, cu_seqlens, bias, max_seqlen, scale)


def _launch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    bias: torch.Tensor,
    max_seqlen: int,
    scale: float,
) -> torch.Tensor:
    kernel = _kernel()
    assert kernel is not None  # guarded by `serves`
    q, k, v = (t if t.stride(2) == 1 else t.contiguous() for t in (q, k, v))
    if bias.stride(3) != 1:  # rows of keys read as runs
        bias = bias.contiguous()
    num_seqs, heads, head_dim = cu_seqlens.shape[0] - 1, q.shape[1], q.shape[2]
    out = q.new_empty(q.shape)
    if q.shape[0] == 0 or num_seqs == 0:
        return out
    grid = (math.ceil(max_seqlen / _BLOCK_M), num_seqs, heads)
    kernel[grid](
        q,
        k,
        v,
        bias,
        out,
        cu_seqlens,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        out.stride(0),
        out.stride(1),
        bias.stride(1),
        bias.stride(2),
        scale * 1.4426950408889634,
        HEAD_DIM=head_dim,
        BLOCK_M=_BLOCK_M,
        BLOCK_N=_BLOCK_N,
        BLOCK_D=max(16, 1 << (head_dim - 1).bit_length()),
        num_warps=4,
        num_stages=2,
    )
    return out


# `biased_attention` for compiled layers: the compiler calls the kernel as it is (`_launch`
# under the operator's schema).
_biased_attention_op = torch.library.custom_op(
    "vecpool::biased_attention",
    _launch,
    mutates_args=(),
    schema="(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens, Tensor bias, SymInt max_seqlen, "
    "float scale) -> Tensor",
)


@_biased_attention_op.register_fake
def _(q: torch.Tensor, *args: object) -> torch.Tensor:
    return q.new_empty(q.shape)
