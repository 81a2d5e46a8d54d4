"""Attention over flat, unpadded batches.

A batch is the concatenation of every scheduled token; `cu_seqlens` marks where each sequence
starts. On CUDA with a half dtype the work goes to `torch.nn.attention.varlen.varlen_attn`
(FlashAttention). Everywhere else — the CPU, float32, logit soft-capping — an exact fallback
scatters the tokens into a padded `[num_seqs, max_len]` layout by index arithmetic, runs masked
attention, and gathers the rows back.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

_FLASH_DTYPES = (torch.float16, torch.bfloat16)


@functools.cache
def _varlen_kernel() -> tuple[Any, bool] | None:
    """(varlen_attn, whether it takes `enable_gqa`), or None on a torch without it.

    Imported on first use: the module pulls in torch's compiler stack, which costs seconds of
    start-up that a CPU engine never needs. torch 2.11's varlen_attn has no `enable_gqa`.
    """
    try:  # torch >= 2.10
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:  # pragma: no cover - older torch has no varlen attention
        return None
    return varlen_attn, "enable_gqa" in inspect.signature(varlen_attn).parameters


def varlen_available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the FlashAttention varlen kernel can serve this device and dtype."""
    return device.type == "cuda" and dtype in _FLASH_DTYPES and _varlen_kernel() is not None


@dataclass
class AttentionMetadata:
    """Where each sequence of a flat batch lies. Built once per step by the model runner."""

    cu_seqlens: torch.Tensor  # [num_seqs + 1] int32, on the model's device
    max_seqlen: int  # longest sequence of this step (host int: no device sync to read it)
    seq_ids: torch.Tensor  # [num_tokens] int64: the sequence each token belongs to
    pos_in_seq: torch.Tensor  # [num_tokens] int64: the token's offset inside its sequence
    use_varlen: bool  # FlashAttention kernel (CUDA, half dtypes) or the exact padded fallback
    # When some sequence's trailing tokens are not attended to (ColBERT's query expansion): the
    # rows every query attends to, as keys, and their boundaries. None: every row is a key.
    key_rows: torch.Tensor | None = None  # [num_keys] int64
    cu_seqlens_k: torch.Tensor | None = None  # [num_seqs + 1] int32, boundaries in key_rows
    max_seqlen_k: int = 0
    # Padded-fallback masks, built at most once per (causal, window) per step.
    _masks: dict[tuple[bool, int | None], torch.Tensor] = field(default_factory=dict, repr=False)

    @property
    def num_seqs(self) -> int:
        return self.cu_seqlens.shape[0] - 1

    def padded_mask(self, causal: bool, window: int | None) -> torch.Tensor:
        """`[num_seqs, 1, max_len, max_len]` bool, True where a query may attend to a key."""
        key = (causal, window)
        mask = self._masks.get(key)
        if mask is None:
            device = self.cu_seqlens.device
            lengths = (self.cu_seqlens[1:] - self.cu_seqlens[:-1]).long()  # [num_seqs]
            cu_k = self.cu_seqlens if self.cu_seqlens_k is None else self.cu_seqlens_k
            key_lengths = (cu_k[1:] - cu_k[:-1]).long()  # [num_seqs]
            idx = torch.arange(self.max_seqlen, device=device)
            q_idx, k_idx = idx[:, None], idx[None, :]  # [L, 1], [1, L]
            allowed = k_idx[None] < key_lengths[:, None, None]  # [B, 1, L] keys attended to
            if causal:
                allowed = allowed & (k_idx <= q_idx)
            if window is not None:
                allowed = allowed & ((q_idx - k_idx).abs() < window)
            # Padding rows attend to themselves so that no softmax row is empty.
            padding = q_idx[None] >= lengths[:, None, None]  # [B, L, 1]
            allowed = allowed | (
                torch.eye(self.max_seqlen, dtype=torch.bool, device=device) & padding
            )
            mask = allowed[:, None]
            self._masks[key] = mask
        return mask


def flat_attention(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    meta: AttentionMetadata,
    *,
    causal: bool,
    scale: float,
    window: int | None = None,  # attend to the last `window` positions (itself included)
    softcap: float | None = None,  # tanh soft-capping of the attention logits
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """Attention of every sequence of a flat batch with itself."""
    if meta.use_varlen and softcap is None:
        return _flash_attention(q, k, v, meta, causal=causal, scale=scale, window=window)
    return _padded_attention(
        q, k, v, meta, causal=causal, scale=scale, window=window, softcap=softcap
    )


def _flash_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    meta: AttentionMetadata,
    *,
    causal: bool,
    scale: float,
    window: int | None,
) -> torch.Tensor:
    kernel = _varlen_kernel()
    assert kernel is not None  # guarded by varlen_available when the runner chose it
    varlen_attn, has_gqa = kernel
    left = -1 if window is None else window - 1
    right = 0 if causal else left
    extra: dict[str, Any] = {}
    if k.shape[1] != q.shape[1]:
        if has_gqa:
            extra["enable_gqa"] = True
        else:
            group = q.shape[1] // k.shape[1]
            k = k.repeat_interleave(group, dim=1)
            v = v.repeat_interleave(group, dim=1)
    cu_k, max_k = meta.cu_seqlens, meta.max_seqlen
    if meta.key_rows is not None:
        # Keys cut short only where every query sees every key (ColBERT's encoders): causal or
        # windowed attention would align the two lengths differently.
        assert meta.cu_seqlens_k is not None and not causal and window is None
        k, v = k[meta.key_rows], v[meta.key_rows]
        cu_k, max_k = meta.cu_seqlens_k, meta.max_seqlen_k
    out = varlen_attn(
        q,
        k,
        v,
        meta.cu_seqlens,
        cu_k,
        meta.max_seqlen,
        max_k,
        scale=scale,
        window_size=(left, right),
        **extra,
    )
    assert isinstance(out, torch.Tensor)
    return out


def _padded_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    meta: AttentionMetadata,
    *,
    causal: bool,
    scale: float,
    window: int | None,
    softcap: float | None,
) -> torch.Tensor:
    num_seqs, max_len = meta.num_seqs, meta.max_seqlen

    def to_padded(x: torch.Tensor) -> torch.Tensor:  # [T, H, D] -> [B, H, L, D]
        padded = x.new_zeros(num_seqs, max_len, x.shape[1], x.shape[2])
        padded[meta.seq_ids, meta.pos_in_seq] = x
        return padded.transpose(1, 2)

    qp, kp, vp = to_padded(q), to_padded(k), to_padded(v)
    if kp.shape[1] != qp.shape[1]:
        group = qp.shape[1] // kp.shape[1]
        kp = kp.repeat_interleave(group, dim=1)
        vp = vp.repeat_interleave(group, dim=1)
    mask = meta.padded_mask(causal, window)  # [B, 1, L, L]
    if softcap is None:
        out = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=mask, scale=scale)
    else:
        scores = torch.matmul(qp, kp.transpose(-1, -2)) * scale
        scores = torch.tanh(scores / softcap) * softcap
        scores = scores.masked_fill(~mask, float("-inf"))
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(qp.dtype)
        out = torch.matmul(probs, vp)
    return out.transpose(1, 2)[meta.seq_ids, meta.pos_in_seq]
