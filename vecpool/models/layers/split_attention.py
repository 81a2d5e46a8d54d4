"""Attention split at shared cached prefixes (shared-prefix caching on the varlen kernel).

Sequences that start with the same cached prefix would each attend to a copy of its keys and
values. Instead, each sequence attends to its keys after the prefix (causally), each group of
sequences reading one prefix attends to it once, all its rows together (every prefix position
comes before them: no mask), and the two results merge by their softmax normalizers: with
`lse` the log-sum-exp of a half's scaled logits, the whole is
`(out_a * exp(lse_a) + out_b * exp(lse_b)) / (exp(lse_a) + exp(lse_b))` — FlashAttention's
own way of joining key blocks. Each half's output is rounded to the model dtype before the
merge, so the result differs from one pass over all keys by about one rounding of that dtype.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from vecpool.models.layers.kv_blocks import SharedPrefixes


def shared_prefix_attention(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    own: tuple[torch.Tensor, torch.Tensor, torch.Tensor, int],  # keys, values, cu_q, max_q
    prefix: tuple[torch.Tensor, torch.Tensor],  # the groups' prefix keys and values
    shared: SharedPrefixes,
    *,
    causal: bool,
    scale: float,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """Every sequence's attention over its prefix (read once per group) and its own keys."""
    own_k, own_v, cu_q, max_q = own
    out, lse = attention_with_lse(
        q, own_k, own_v, cu_q, shared.own_cu_k, max_q, shared.own_max_k, scale=scale, causal=causal
    )
    group_out, group_lse = attention_with_lse(
        q.index_select(0, shared.q_rows),
        *prefix,
        shared.cu_q,
        shared.cu_k,
        shared.max_q,
        shared.max_k,
        scale=scale,
        causal=False,
    )
    merge_rows_ = _triton_merge() if out.is_cuda else None
    if merge_rows_ is not None:
        merge_rows_(out, lse, group_out, group_lse, shared.q_rows)
        return out
    merged = merge_attention(
        out.index_select(0, shared.q_rows), lse.index_select(1, shared.q_rows), group_out, group_lse
    )
    return out.index_copy_(0, shared.q_rows, merged)


def merge_attention(
    out_a: torch.Tensor,  # [n, num_heads, head_dim]: attention over one set of keys
    lse_a: torch.Tensor,  # [num_heads, n] float32: its log-sum-exps of the scaled logits
    out_b: torch.Tensor,  # [n, num_heads, head_dim]: over another, disjoint set
    lse_b: torch.Tensor,  # [num_heads, n] float32
) -> torch.Tensor:  # [n, num_heads, head_dim]: attention over both sets of keys
    """Each half weighted by its share of the whole softmax normalizer, in float32."""
    a = lse_a.t().unsqueeze(-1)  # [n, num_heads, 1]
    b = lse_b.t().unsqueeze(-1)
    top = torch.maximum(a, b)
    weight_a, weight_b = torch.exp(a - top), torch.exp(b - top)
    merged = (out_a.float() * weight_a + out_b.float() * weight_b) / (weight_a + weight_b)
    return merged.to(out_a.dtype)


def attention_with_lse(
    q: torch.Tensor,  # [num_q, num_heads, head_dim]
    k: torch.Tensor,  # [num_keys, num_kv_heads, head_dim]
    v: torch.Tensor,
    cu_q: torch.Tensor,  # [num_seqs + 1] int32
    cu_k: torch.Tensor,  # [num_seqs + 1] int32
    max_q: int,
    max_k: int,
    *,
    scale: float,
    causal: bool,  # aligned to the end of the keys
    window_left: int = -1,  # on CUDA: keys seen before a query (and after, not causal); -1 all
) -> tuple[torch.Tensor, torch.Tensor]:  # [num_q, num_heads, head_dim], [num_heads, num_q] f32
    """Variable-length attention and each query's log-sum-exp of its scaled logits: the
    FlashAttention kernel on CUDA (grouped-query heads read in place), a per-sequence reference
    elsewhere (the CPU runs its own attention; this serves its tests)."""
    if q.is_cuda:
        out, lse = torch.ops.aten._flash_attention_forward(
            q,
            k,
            v,
            cu_q,
            cu_k,
            max_q,
            max_k,
            0.0,  # dropout
            causal and window_left == -1,  # is_causal, derived as varlen_attn derives it
            False,  # return_debug_mask
            scale=scale,
            window_size_left=window_left,
            window_size_right=0 if causal else window_left,
        )[:2]
        return out, lse
    if window_left != -1:
        raise NotImplementedError("a window in the CPU reference of attention_with_lse")
    # As the kernel: rows of no sequence (a padded step's) are left as they are, here zero
    # with a log-sum-exp of -inf.
    out = torch.zeros(q.shape[0], q.shape[1], v.shape[2])
    lse = torch.full((q.shape[1], q.shape[0]), float("-inf"))
    bounds_q, bounds_k = cu_q.tolist(), cu_k.tolist()
    group = q.shape[1] // k.shape[1]
    for i in range(len(bounds_q) - 1):
        rows = slice(bounds_q[i], bounds_q[i + 1])
        qs = q[rows].float()
        ks = k[bounds_k[i] : bounds_k[i + 1]].float().repeat_interleave(group, dim=1)
        vs = v[bounds_k[i] : bounds_k[i + 1]].float().repeat_interleave(group, dim=1)
        logits = torch.einsum("qhd,khd->hqk", qs, ks) * scale
        if causal:
            n_q, n_k = qs.shape[0], ks.shape[0]
            later = torch.ones(n_q, n_k, dtype=torch.bool).triu(n_k - n_q + 1)
            logits = logits.masked_fill(later, float("-inf"))
        lse[:, rows] = torch.logsumexp(logits, dim=-1)
        out[rows] = torch.einsum("hqk,khd->qhd", torch.softmax(logits, dim=-1), vs)
    return out.to(q.dtype), lse


@functools.cache
def _triton_merge() -> Any | None:
    """`merge_attention` over the rows `rows` of `out` in place, one Triton kernel (the torch
    form is about ten kernels per layer); None where Triton is not installed."""
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None

    @triton.jit
    def kernel(  # type: ignore[no-untyped-def]
        out_ptr,  # [num_tokens, H, D]: the own half, overwritten with the merge at `rows`
        lse_ptr,  # [H, num_tokens] float32
        part_ptr,  # [n, H, D]: the prefix half of rows[0..n)
        part_lse_ptr,  # [H, n] float32
        rows_ptr,  # [n] int64
        stride_ot,
        stride_oh,
        stride_lh,
        stride_lt,
        stride_pt,
        stride_ph,
        stride_qh,
        stride_qt,
        H: tl.constexpr,
        D: tl.constexpr,
        BLOCK_H: tl.constexpr,
        BLOCK_D: tl.constexpr,
    ):
        i = tl.program_id(0)  # one row, every head: [BLOCK_H, BLOCK_D] at once
        row = tl.load(rows_ptr + i)
        h = tl.arange(0, BLOCK_H)
        d = tl.arange(0, BLOCK_D)
        on_h = h < H
        a = tl.load(lse_ptr + h * stride_lh + row * stride_lt, mask=on_h, other=0.0)
        b = tl.load(part_lse_ptr + h * stride_qh + i * stride_qt, mask=on_h, other=0.0)
        top = tl.maximum(a, b)
        weight_a = tl.exp(a - top)[:, None]
        weight_b = tl.exp(b - top)[:, None]
        mask = on_h[:, None] & (d < D)[None, :]
        own = out_ptr + row * stride_ot + h[:, None] * stride_oh + d[None, :]
        x = tl.load(own, mask=mask).to(tl.float32)
        part = part_ptr + i * stride_pt + h[:, None] * stride_ph + d[None, :]
        y = tl.load(part, mask=mask).to(tl.float32)
        merged = (x * weight_a + y * weight_b) / (weight_a + weight_b)
        tl.store(own, merged.to(out_ptr.dtype.element_ty), mask=mask)

    def merge_rows(
        out: torch.Tensor,
        lse: torch.Tensor,
        part: torch.Tensor,
        part_lse: torch.Tensor,
        rows: torch.Tensor,
    ) -> None:
        n, heads, dim = part.shape
        if n == 0:
            return
        kernel[(n,)](
            out,
            lse,
            part,
            part_lse,
            rows,
            out.stride(0),
            out.stride(1),
            lse.stride(0),
            lse.stride(1),
            part.stride(0),
            part.stride(1),
            part_lse.stride(0),
            part_lse.stride(1),
            H=heads,
            D=dim,
            BLOCK_H=triton.next_power_of_2(heads),
            BLOCK_D=triton.next_power_of_2(dim),
        )

    return merge_rows
