"""The Triton kernel of `qk_rotary` (its docstring says what and why).

Imported by `qk_rotary` when the kernel first runs: this module imports Triton.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def rotate_heads(  # type: ignore[no-untyped-def]
    x_ptr,
    out_ptr,
    weight_ptr,
    c1,
    c2,
    s1,
    s2,
    rows,
    cols,
    mask,
    stride_x,
    eps,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    NORM: tl.constexpr,
    UNIT_OFFSET: tl.constexpr,
):
    HALF: tl.constexpr = HEAD_DIM // 2
    w1 = tl.full((1, BLOCK_H), 1.0, tl.float32)
    w2 = w1
    if NORM:
        col_ok = cols < HALF
        w1 = tl.load(weight_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        w2 = tl.load(weight_ptr + HALF + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        if UNIT_OFFSET:
            w1, w2 = w1 + 1.0, w2 + 1.0
    stride_out: tl.constexpr = NUM_HEADS * HEAD_DIM
    out_ty = out_ptr.dtype.element_ty
    for h in range(NUM_HEADS):
        x_at = x_ptr + h * HEAD_DIM + rows[:, None] * stride_x + cols[None, :]
        x1 = tl.load(x_at, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(x_at + HALF, mask=mask, other=0.0).to(tl.float32)
        if NORM:
            mean_square = (tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / HEAD_DIM
            r = tl.rsqrt(mean_square + eps)[:, None]
            # Rounded as the norm module's output is, before the rotation reads it.
            x1 = (x1 * r * w1).to(out_ty).to(tl.float32)
            x2 = (x2 * r * w2).to(out_ty).to(tl.float32)
        out_at = out_ptr + h * HEAD_DIM + rows[:, None] * stride_out + cols[None, :]
        tl.store(out_at, (x1 * c1 - x2 * s1).to(out_ty), mask=mask)
        tl.store(out_at + HALF, (x2 * c2 + x1 * s2).to(out_ty), mask=mask)


@triton.jit
def qk_rotary_kernel(  # type: ignore[no-untyped-def]
    q_ptr,
    k_ptr,
    q_weight_ptr,
    k_weight_ptr,
    cos_ptr,
    sin_ptr,
    q_out_ptr,
    k_out_ptr,
    num_tokens,
    stride_q,
    stride_k,
    stride_cs,
    eps,
    HEADS: tl.constexpr,
    KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_H: tl.constexpr,
    NORM: tl.constexpr,
    UNIT_OFFSET: tl.constexpr,
):
    HALF: tl.constexpr = HEAD_DIM // 2
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, BLOCK_H)
    mask = (rows < num_tokens)[:, None] & (cols < HALF)[None, :]
    cs_at = rows[:, None] * stride_cs + cols[None, :]
    c1 = tl.load(cos_ptr + cs_at, mask=mask, other=0.0).to(tl.float32)
    c2 = tl.load(cos_ptr + cs_at + HALF, mask=mask, other=0.0).to(tl.float32)
    s1 = tl.load(sin_ptr + cs_at, mask=mask, other=0.0).to(tl.float32)
    s2 = tl.load(sin_ptr + cs_at + HALF, mask=mask, other=0.0).to(tl.float32)
    rotate_heads(
        q_ptr, q_out_ptr, q_weight_ptr, c1, c2, s1, s2, rows, cols, mask, stride_q, eps,
        HEADS, HEAD_DIM, BLOCK_H, NORM, UNIT_OFFSET,
    )  # fmt: skip
    rotate_heads(
        k_ptr, k_out_ptr, k_weight_ptr, c1, c2, s1, s2, rows, cols, mask, stride_k, eps,
        KV_HEADS, HEAD_DIM, BLOCK_H, NORM, UNIT_OFFSET,
    )  # fmt: skip
