"""Query and key heads' RMSNorm (Qwen3, Gemma3) and rotary positions as one Triton kernel.

Compiled, the decoder's `q_norm` / `k_norm` and `apply_rotary` became two reductions of
Inductor's that ran at about a third of the H200's memory bandwidth: 238 µs a layer for a step
of 31k tokens of the Qwen3-0.6B shape, 10.5% of its device time
(`phases_kernels_qwen3-0.6b_packed_h200.json`). Here one program takes a block of tokens,
loads their cos / sin once and walks every query and key head: each head read once, normalized
in float32 (rounded to the dtype as the norm module's output is), rotated, written once. Per
token and per head, nothing crosses tokens: a row's result does not depend on its step (the
batch-invariant mode keeps it). End to end on the H200: Qwen3-0.6B 1.033x (queries) and 1.048x
(passages) from ids (`ab_qk_rotary_packed_steps_h200.json`).

The decoder takes it only in steps that attend through `packed_attention`'s kernel: through
it in every step, EmbeddingGemma-300m's passages (steps that go to FlashAttention) ran 0.958x
(`ab_qk_rotary_embeddinggemma-300m_all_steps_h200.json`; why is not measured: no profile of
that model's steps); in packed steps only, 0.98-1.00x.

`qk_norm_rotary` returns new query and key tensors; the value heads stay the view they were.
Without the norms (`q_weight=None`) it rotates alone, but the models leave that to Inductor:
compiled, the rotation alone fuses as well (`qk_rotary_check_layouts_h200.json`: Mistral-7B's
layout 172 µs compiled against 181, Qwen2-1.5B's 69 against 64) and into its neighbours
(ModernBERT 0.97-0.98x end to end through the kernel, `ab_qk_rotary_h200.json`).
"""

from __future__ import annotations

import functools
import importlib.util
from typing import Any

import torch

# Whether Triton is installed, known without importing it (compiled layers ask too, and the
# compiler cannot trace Triton's import).
_HAS_TRITON = importlib.util.find_spec("triton") is not None

# The widest head the kernel takes (Gemma's 256).
_MAX_HEAD_DIM = 256

# Tokens a program takes, and its warps: of the tiles timed on the H200 at Qwen3-0.6B's layout
# (`qk_rotary_check_qwen3-0.6b_h200.json`), within 1% of the fastest at 32,768 tokens and 5% at
# 512.
_TILE = (32, 8)


@functools.cache
def _kernel() -> Any | None:
    try:
        from vecpool.models.layers.qk_rotary_kernel import qk_rotary_kernel
    except ImportError:  # pragma: no cover - `_HAS_TRITON` says so first
        return None
    return qk_rotary_kernel


def serves(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """Whether the kernel can take these heads (`[num_tokens, heads, head_dim]`, each row's
    heads side by side) and these `cos` / `sin` (`[num_tokens, head_dim]`, one layout): on
    CUDA, an even head size it takes, and Triton present."""
    n, _, head_dim = q.shape
    return (
        q.is_cuda
        and _HAS_TRITON
        and head_dim % 2 == 0
        and head_dim <= _MAX_HEAD_DIM
        and k.shape[0] == n
        and k.shape[2] == head_dim
        and cos.shape == sin.shape == (n, head_dim)
        and cos.stride() == sin.stride()
        and cos.stride(1) == 1
        and all(t.stride(2) == 1 and t.stride(1) == head_dim for t in (q, k))
        # The kernel's offsets are 32-bit.
        and n * max(q.stride(0), k.stride(0), cos.stride(0)) < 2**31
    )


def qk_norm_rotary(
    q: torch.Tensor,  # [num_tokens, heads, head_dim]
    k: torch.Tensor,  # [num_tokens, kv_heads, head_dim]
    cos: torch.Tensor,  # [num_tokens, head_dim]
    sin: torch.Tensor,  # [num_tokens, head_dim]
    q_weight: torch.Tensor | None,  # [head_dim]; None: no norm
    k_weight: torch.Tensor | None,  # [head_dim]
    eps: float,
    unit_offset: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`apply_rotary(q_norm(q))` and the same for `k`, new tensors of `q`'s and `k`'s shapes."""
    if torch.compiler.is_compiling():
        return torch.ops.vecpool.qk_norm_rotary(
            q, k, cos, sin, q_weight, k_weight, eps, unit_offset
        )
    return _launch(q, k, cos, sin, q_weight, k_weight, eps, unit_offset)


def _launch(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    q_weight: torch.Tensor | None,
    k_weight: torch.Tensor | None,
    eps: float,
    unit_offset: bool,
    tile: tuple[int, int] | None = None,  # (tokens a program, warps); None: `_TILE`
) -> tuple[torch.Tensor, torch.Tensor]:
    kernel = _kernel()
    assert kernel is not None  # guarded by `serves`
    n, heads, head_dim = q.shape
    q_out = q.new_empty(q.shape)
    k_out = k.new_empty(k.shape)
    if n == 0:
        return q_out, k_out
    norm = q_weight is not None and k_weight is not None
    block_t, warps = tile or _TILE
    kernel[(-(-n // block_t),)](
        q,
        k,
        q_weight if norm else cos,  # not read without the norm
        k_weight if norm else cos,
        cos,
        sin,
        q_out,
        k_out,
        n,
        q.stride(0),
        k.stride(0),
        cos.stride(0),
        eps,
        HEADS=heads,
        KV_HEADS=k.shape[1],
        HEAD_DIM=head_dim,
        BLOCK_T=block_t,
        BLOCK_H=max(16, 1 << (head_dim // 2 - 1).bit_length()),
        NORM=norm,
        UNIT_OFFSET=unit_offset,
        num_warps=warps,
    )
    return q_out, k_out


# `qk_norm_rotary` for compiled layers: the compiler calls the kernel as it is (`_launch` under
# the operator's schema, the default tile).
_qk_norm_rotary_op = torch.library.custom_op(
    "vecpool::qk_norm_rotary",
    _launch,
    mutates_args=(),
    schema="(Tensor q, Tensor k, Tensor cos, Tensor sin, Tensor? q_weight, Tensor? k_weight, "
    "float eps, bool unit_offset) -> (Tensor, Tensor)",
)


@_qk_norm_rotary_op.register_fake
def _(q: torch.Tensor, k: torch.Tensor, *args: object) -> tuple[torch.Tensor, torch.Tensor]:
    return q.new_empty(q.shape), k.new_empty(k.shape)
