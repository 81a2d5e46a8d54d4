"""Attention of short sequences packed into tiles of the flat batch, on CUDA.

FlashAttention's varlen kernel gives every (sequence, head) pair programs of its own, each
loading a tile of 128 query rows and walking that sequence's keys. A query of 36 tokens fills
under a third of its tile, and a step of 700 queries launches 11,200 programs per layer whose
fixed cost (loading, the softmax's bookkeeping, storing) outweighs their work: on the H200,
Qwen3-0.6B's attention over such a step ran at ~13 TFLOP/s, 16% of the step's device time
(`profile_phases.py`, `phases_kernels_qwen3-0.6b_h200.json`). Under a CUDA graph, whose
sequence slots are padded to a power of two, the empty slots add programs that only return.

This Triton kernel tiles the flat rows instead: one program per (block of `BLOCK_M`
consecutive rows, query head), whatever sequences those rows belong to. Each row finds its
sequence in `cu_seqlens` (a binary search), the program walks the keys from its first row's
sequence start to its last row's sequence end, and a key counts for a row only inside the
row's own sequence (and, causal, at or before it). The softmax runs FlashAttention's way, in
float32 with a running maximum. A row's result depends on its sequence alone, but the order
in which its keys are summed depends on where the sequence starts within its tile: the same
prompt in another step can differ in the last bits, which is why batch-invariant engines keep
the per-sequence kernel (`AttentionMetadata.batch_invariant`).

Used where every sequence of the step is at most `max_len(causal)` tokens long: 128 for
bidirectional models, 1,024 for causal ones, as measured against FlashAttention (`MAX_LEN`).
Grouped-query attention reads each query head's key/value head directly, and a program takes
as many query heads of one key/value head as `GQA_TILE` says, loading each key and value block
once for all of them. Compiled layers call it through `vecpool::packed_attention`, an op opaque
to the compiler.
"""

from __future__ import annotations

import functools
import importlib.util
import math
from collections.abc import Sequence
from typing import Any

import torch

# The longest sequence (tokens) of a step for which the engine uses this kernel
# (`max_len`), bidirectional and causal. Measured on the H200 (`packed_attention_check.py`,
# kernel time against FlashAttention's): at Qwen3-0.6B's causal layout (16 query heads on 8
# key/value heads of 128) 1.2-2.0x up to 1,024-token sequences, even (1.0x) at 2,048-4,096; at
# BERT's and MiniLM's bidirectional ones (heads of 64 and 32) 1.6-3.1x up to 64 tokens, 1.0-1.1x
# at 64-128, 0.8-0.9x from 512 on, and a whole BERT-base passages workload (up to 512 tokens)
# 0.98x end to end.
MAX_LEN = 128
MAX_LEN_CAUSAL = 1024
# Head sizes up to this one: those measured (32, 64, 128); wider heads (Gemma's 256) would hold
# a 64 x 256 float32 accumulator per program, and keep FlashAttention.
_MAX_HEAD_DIM = 128
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

    # The step's sequence count is a plain argument, not a specialization (the search loop's
    # length too): two compiles per model (its row count divisible by 16 or not) serve every
    # step, where specializing it compiled a kernel per size class, each a compile that some
    # step waits for. Rows left unspecialized as well cost 14% on passages
    # (`packed_attention_check_unspecialized_h200.json`).
    @triton.jit(do_not_specialize=["num_seqs", "search_steps"])
    def packed_attention_kernel(  # type: ignore[no-untyped-def]
        q_ptr,
        k_ptr,
        v_ptr,
        out_ptr,
        cu_ptr,
        num_seqs,
        num_rows,
        stride_qt,
        stride_qh,
        stride_kt,
        stride_kh,
        stride_vt,
        stride_vh,
        stride_ot,
        stride_oh,
        qk_scale,  # the logits' scale times log2(e): softmax runs in base 2
        search_steps,  # enough halvings to find one of num_seqs sequences
        GROUP: tl.constexpr,  # query heads per key/value head
        HEADS: tl.constexpr,  # query heads per program, of one key/value head (divides GROUP)
        CAUSAL: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_D: tl.constexpr,
    ):
        # The program's tile: its BLOCK_M rows once for each of its HEADS query heads, which
        # share one key/value head, so that each key and value block is loaded once for all.
        tile = tl.arange(0, HEADS * BLOCK_M)
        head = tl.program_id(1) * HEADS + tile // BLOCK_M
        kv_head = (tl.program_id(1) * HEADS) // GROUP
        rows = tl.program_id(0) * BLOCK_M + tile % BLOCK_M
        row_ok = rows < num_rows
        # Each row's sequence: the last s < num_seqs with cu[s] <= row (cu[0] = 0 <= row holds
        # for lo throughout). Empty sequences repeat a boundary and are never the last such s
        # of a row they do not hold; rows past the last sequence (a graph's padding) land in
        # the last one, computing values nobody reads.
        lo = tl.zeros([HEADS * BLOCK_M], tl.int32)
        hi = tl.zeros([HEADS * BLOCK_M], tl.int32) + num_seqs
        for _ in range(search_steps):
            mid = (lo + hi) // 2
            right = tl.load(cu_ptr + mid) <= rows
            lo = tl.where(right, mid, lo)
            hi = tl.where(right, hi, mid)
        seq_start = tl.load(cu_ptr + lo)
        seq_end = tl.load(cu_ptr + lo + 1)
        if CAUSAL:
            seq_end = tl.minimum(seq_end, rows + 1)
        key_lo = tl.min(seq_start, 0)
        key_hi = tl.max(tl.where(row_ok, seq_end, 0), 0)
        dims = tl.arange(0, BLOCK_D)
        dim_ok = dims < HEAD_DIM
        cols = tl.arange(0, BLOCK_N)
        q = tl.load(
            q_ptr + rows[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :],
            mask=row_ok[:, None] & dim_ok[None, :],
            other=0.0,
        )
        m_i = tl.full([HEADS * BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([HEADS * BLOCK_M], tl.float32)
        acc = tl.zeros([HEADS * BLOCK_M, BLOCK_D], tl.float32)
        for first in range(key_lo, key_hi, BLOCK_N):
            keys = first + cols
            kv_mask = (keys < key_hi)[:, None] & dim_ok[None, :]
            k = tl.load(
                k_ptr + keys[:, None] * stride_kt + kv_head * stride_kh + dims[None, :],
                mask=kv_mask,
                other=0.0,
            )
            s = tl.dot(q, tl.trans(k)) * qk_scale
            seen = (keys[None, :] >= seq_start[:, None]) & (keys[None, :] < seq_end[:, None])
            s = tl.where(seen, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            # A row none of whose keys came yet keeps a maximum of -inf: exponents from 0.
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2(m_i - m_use)
            p = tl.exp2(s - m_use[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(
                v_ptr + keys[:, None] * stride_vt + kv_head * stride_vh + dims[None, :],
                mask=kv_mask,
                other=0.0,
            )
            acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
            m_i = m_new
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(
            out_ptr + rows[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=row_ok[:, None] & dim_ok[None, :],
        )

    return packed_attention_kernel


def max_len(causal: bool) -> int:
    """The longest sequence of a step that a model of this kind attends to through the
    kernel."""
    return MAX_LEN_CAUSAL if causal else MAX_LEN


def serves(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether the kernel can run this attention: on CUDA in a half dtype, key/value heads
    dividing the query heads, a head size it takes, and Triton present."""
    return (
        q.is_cuda
        and q.dtype in (torch.float16, torch.bfloat16)
        and k.shape[0] == q.shape[0]
        and q.shape[1] % k.shape[1] == 0
        and v.shape[2] == q.shape[2] <= _MAX_HEAD_DIM
        # The kernel's offsets are 32-bit.
        and q.shape[0] * max(q.stride(0), k.stride(0), v.stride(0)) < 2**31
        and _HAS_TRITON
    )


def packed_attention(
    q: torch.Tensor,  # [num_tokens, heads, head_dim], rows of head_dim values
    k: torch.Tensor,  # [num_tokens, kv_heads, head_dim]
    v: torch.Tensor,  # [num_tokens, kv_heads, head_dim]
    cu_seqlens: torch.Tensor,  # [num_seqs + 1] int32
    causal: bool,
    scale: float,
) -> torch.Tensor:  # [num_tokens, heads, head_dim]
    """Each sequence attending to itself (causal: each row to itself and the rows before)."""
    if torch.compiler.is_compiling():
        return torch.ops.vecpool.packed_attention(q, k, v, cu_seqlens, causal, scale)
    return _launch(q, k, v, cu_seqlens, causal, scale)


# The tile: rows per program, keys per inner step, warps. Of those timed on the H200 at head
# sizes 32, 64 and 128 (`packed_attention_check.py --tiles`), the fastest or within 10% of it
# on every step.
_TILE = (64, 32, 4)
# Grouped-query attention's tile, the fourth number the query heads one program takes (of one
# key/value head): used where that count divides the model's group.
GQA_TILE: tuple[int, int, int, int] | None = (32, 32, 4, 2)


def tile_for(group: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, warps, heads per program) for a model of `group` query heads per
    key/value head."""
    if GQA_TILE is not None and group % GQA_TILE[3] == 0:
        return GQA_TILE
    return (*_TILE, 1)


def _launch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    causal: bool,
    scale: float,
    # (BLOCK_M, BLOCK_N, warps[, heads per program]); None: `tile_for` the model's group
    tiles: Sequence[int] | None = None,
) -> torch.Tensor:
    kernel = _kernel()
    assert kernel is not None  # guarded by `serves`
    q, k, v = (t if t.stride(2) == 1 else t.contiguous() for t in (q, k, v))
    num_seqs, heads, head_dim = cu_seqlens.shape[0] - 1, q.shape[1], q.shape[2]
    out = q.new_empty(q.shape)
    if q.shape[0] == 0 or num_seqs == 0:
        return out
    block_d = max(16, 1 << (head_dim - 1).bit_length())
    group = heads // k.shape[1]
    block_m, block_n, warps, per_program = (*tiles, 1)[:4] if tiles else tile_for(group)
    if group % per_program:
        raise ValueError(f"{per_program} query heads a program do not divide groups of {group}")
    grid = (math.ceil(q.shape[0] / block_m), heads // per_program)
    kernel[grid](
        q,
        k,
        v,
        out,
        cu_seqlens,
        num_seqs,
        q.shape[0],
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        out.stride(0),
        out.stride(1),
        scale * 1.4426950408889634,
        max(1, num_seqs.bit_length()),
        GROUP=group,
        HEADS=per_program,
        CAUSAL=causal,
        HEAD_DIM=head_dim,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_D=block_d,
        num_warps=warps,
        num_stages=2,
    )
    return out


# `packed_attention` for compiled layers: the compiler calls the kernel as it is (`_launch`
# under the operator's schema).
_packed_attention_op = torch.library.custom_op(
    "vecpool::packed_attention",
    _launch,
    mutates_args=(),
    schema="(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens, bool causal, float scale, "
    "int[]? tiles=None) -> Tensor",
)


@_packed_attention_op.register_fake
def _(q: torch.Tensor, *args: object) -> torch.Tensor:
    return q.new_empty(q.shape)
