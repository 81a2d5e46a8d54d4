"""Attention over flat, unpadded batches.

A batch is the concatenation of every scheduled token; `cu_seqlens` marks where each sequence
starts. On CUDA with a half dtype the work goes to `torch.nn.attention.varlen.varlen_attn`
(FlashAttention), and an additive bias shared by every sequence to `biased_attention`'s kernel.
Everywhere else — the CPU, float32, logit soft-capping, a bias per sequence — an exact fallback
scatters the tokens into a padded `[num_seqs, max_len]` layout by index arithmetic, runs masked
attention, and gathers the rows back. On the CPU a step's plain attention (no bias, soft-capping,
window within a sequence, cached keys or batch-invariant mode) runs as the engine chose for the
machine (`AttentionMetadata.cpu_attention`): padded so, by groups of similar lengths each padded
to its own longest, or one sequence at a time (`cpu_attention.py`).

A causal prompt longer than a step's token budget runs in chunks over several steps: each chunk
attends to its own rows and to the keys and values its earlier chunks left in `KVBuffers`
(`ChunkedKV` says which), with the chunk's queries aligned to the end of its keys. That
attention reads and writes the runner's buffers, which a compiled graph cannot trace: compiled
layers reach it through one custom op, `vecpool::cached_attention`, opaque to the compiler, so
such steps run each layer as one graph instead of breaking it around the attention.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from vecpool.models.layers import (
    biased_attention,
    cpu_attention,
    invariant,
    packed_attention,
    split_attention,
)
from vecpool.models.layers.cpu_attention import GROUP_COST_LOGITS, BucketPlan
from vecpool.models.layers.cpu_attention import joint_rows as _joint_rows
from vecpool.models.layers.kv_blocks import ChunkedKV

_FLASH_DTYPES = (torch.float16, torch.bfloat16)


# `_varlen_kernel()`'s answer once it has been asked (when a runner chooses its attention),
# read as a plain global by the attention: the compiler traces into a cached function's body
# (and warns that it does) rather than calling it.
_varlen: tuple[Any, bool] | None = None


@functools.cache
def _varlen_kernel() -> tuple[Any, bool] | None:
    """(varlen_attn, whether it takes `enable_gqa`), or None on a torch without it.

    Imported on first use: the module pulls in torch's compiler stack, which costs seconds of
    start-up that a CPU engine never needs. torch 2.11's varlen_attn has no `enable_gqa`.
    """
    global _varlen
    try:  # torch >= 2.10
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:  # pragma: no cover - older torch has no varlen attention
        return None
    _varlen = varlen_attn, "enable_gqa" in inspect.signature(varlen_attn).parameters
    return _varlen


def varlen_available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the FlashAttention varlen kernel can serve this device and dtype."""
    return device.type == "cuda" and dtype in _FLASH_DTYPES and _varlen_kernel() is not None


class GraphUnsupported(RuntimeError):
    """A forward being recorded as a CUDA graph reached code that a replay would get wrong."""


@dataclass
class AttentionMetadata:
    """Where each sequence of a flat batch lies. Built once per step by the model runner."""

    cu_seqlens: torch.Tensor  # [num_seqs + 1] int32, on the model's device
    max_seqlen: int  # longest sequence of this step (host int: no device sync to read it)
    # Not read by the varlen kernel: under a recorded CUDA graph (`static`) without cached
    # prefixes they hold another step's values (`StepGraphs._fill`).
    seq_ids: torch.Tensor  # [num_tokens] int64: the sequence each token belongs to
    pos_in_seq: torch.Tensor  # [num_tokens] int64: the token's offset inside its sequence
    use_varlen: bool  # FlashAttention kernel (CUDA, half dtypes) or the exact padded fallback
    # When some sequence's trailing tokens are not attended to (ColBERT's query expansion): the
    # rows every query attends to, as keys, and their boundaries. None: every row is a key.
    key_rows: torch.Tensor | None = None  # [num_keys] int64
    cu_seqlens_k: torch.Tensor | None = None  # [num_seqs + 1] int32, boundaries in key_rows
    max_seqlen_k: int = 0
    # Chunked prompts: the keys and values of their earlier chunks. None: every prompt is whole.
    kv: ChunkedKV | None = None
    # A CUDA graph is being recorded with this metadata: only the varlen kernel may run (the
    # padded fallback's shapes depend on the step, which a replay would not see).
    static: bool = False
    # Batch-invariant mode: the padded fallback runs `invariant.padded_attention`, whose rows do
    # not depend on the step's longest sequence (the varlen kernel is per sequence already).
    batch_invariant: bool = False
    # Every sequence is short enough for `packed_attention`'s kernel, which then serves the
    # step's plain attention in place of the varlen kernel (set by the model runner).
    packed: bool = False
    # How the CPU runs plain attention (`cpu_attention.CPU_ATTENTION_MODES`): the exact padded
    # layout, groups of similar lengths, or one sequence at a time (set by the model runner).
    cpu_attention: str = "padded"
    # What one more group of lengths costs, in logits of one head (measured per machine).
    cpu_group_cost: float = GROUP_COST_LOGITS
    # Padded-fallback masks, built at most once per (causal, window) per step.
    _masks: dict[tuple[bool, int | None], torch.Tensor] = field(default_factory=dict, repr=False)
    # Padded-fallback layouts of q, k and v, zeroed once per step and rewritten by every layer.
    _padded: dict[tuple[str, torch.Size, torch.dtype], torch.Tensor] = field(
        default_factory=dict, repr=False
    )
    # The step's groups for `cpu_attention == "buckets"`, planned by its first layer.
    _buckets: BucketPlan | None = field(default=None, repr=False)
    # The last biased attention's additive mask: (bias, mask, bias where allowed, else -inf).
    _biased: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = field(
        default=None, repr=False
    )

    @property
    def num_seqs(self) -> int:
        return self.cu_seqlens.shape[0] - 1

    def padded_buffer(self, name: str, shape: torch.Size, like: torch.Tensor) -> torch.Tensor:
        """A zeroed `shape` tensor (dtype and device of `like`) for the padded layout of `name`
        ("q", "k" or "v"), kept for the step's next layers: every layer writes the same rows of
        it, so its padding stays zero, and the step allocates and zeroes it once instead of once
        per layer (on the CPU a fresh tensor of this size is fresh pages, zero-filled by the
        kernel and then again by torch). Inside a compiled graph, a fresh tensor each time."""
        if torch.compiler.is_compiling():
            return like.new_zeros(shape)
        key = (name, shape, like.dtype)
        buffer = self._padded.get(key)
        if buffer is None:
            buffer = self._padded[key] = like.new_zeros(shape)
        return buffer

    def additive_mask(
        self, bias: torch.Tensor, mask: torch.Tensor, dtype: torch.dtype
    ) -> torch.Tensor:  # [num_seqs, heads, max_len, max_key_len]
        """`bias` where `mask` allows attending, -inf elsewhere, in `dtype`. Kept for the
        step's next layers while they pass the same bias (MPNet's, T5's and ALiBi's are one
        per step; DeBERTa's, one per layer, is built each time): building it costs a write of
        the whole padded score shape. Inside a compiled graph, built each time."""
        if torch.compiler.is_compiling():
            return bias.to(dtype).masked_fill(~mask, float("-inf"))
        cached = self._biased
        if (
            cached is None
            or cached[0] is not bias
            or cached[1] is not mask
            or cached[2].dtype != dtype
        ):
            cached = self._biased = (bias, mask, bias.to(dtype).masked_fill(~mask, float("-inf")))
        return cached[2]

    def padded_mask(self, causal: bool, window: int | None) -> torch.Tensor:
        """`[num_seqs, 1, max_len, max_key_len]` bool, True where a query may attend to a key.

        Queries are aligned to the end of their keys: with cached positions before a chunk,
        query `i` of a sequence with `q` queries and `n` keys sits at key position
        `i + n - q`."""
        key = (causal, window)
        mask = self._masks.get(key)
        if mask is None:
            device = self.cu_seqlens.device
            lengths = (self.cu_seqlens[1:] - self.cu_seqlens[:-1]).long()  # [num_seqs]
            if self.kv is not None:
                cu_k, max_k = self.kv.cu_seqlens_k, self.kv.max_seqlen_k
            else:  # keys in the queries' layout, perhaps fewer of them (key_rows)
                cu_k = self.cu_seqlens if self.cu_seqlens_k is None else self.cu_seqlens_k
                max_k = self.max_seqlen
            key_lengths = (cu_k[1:] - cu_k[:-1]).long()  # [num_seqs]
            offsets = key_lengths - lengths if self.kv is not None else torch.zeros_like(lengths)
            q_idx = torch.arange(self.max_seqlen, device=device)[None, :, None]  # [1, Lq, 1]
            k_idx = torch.arange(max_k, device=device)[None, None, :]  # [1, 1, Lk]
            q_pos = q_idx + offsets[:, None, None]  # [B, Lq, 1]: the query's key position
            allowed = k_idx < key_lengths[:, None, None]  # [B, 1, Lk] keys attended to
            if causal:
                allowed = allowed & (k_idx <= q_pos)
            if window is not None:
                allowed = allowed & ((q_pos - k_idx).abs() < window)
            # Padding rows attend to the first key so that no softmax row is empty.
            padding = q_idx >= lengths[:, None, None]  # [B, Lq, 1]
            allowed = allowed | (padding & (k_idx == 0))
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
    bias: torch.Tensor | None = None,  # [1 or num_seqs, num_heads, max_seqlen, max_seqlen]
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """Attention of every sequence of a flat batch with itself (and, for a chunk of a longer
    prompt, with its prompt's earlier positions).

    `bias` is added to the scaled logits in the padded layout (relative position buckets,
    ALiBi): query `i` and key `j` of a sequence meet at `bias[s, h, i, j]`, a size-1 first axis
    serving every sequence. The varlen kernel takes no bias: where the varlen path runs, one
    bias for every sequence goes to `biased_attention`'s kernel instead; any other bias runs
    the exact padded fallback, and never with chunked prompts (encoders only)."""
    biased_kernel = (
        bias is not None
        and meta.use_varlen
        and meta.kv is None
        and meta.key_rows is None
        and not causal
        and window is None
        and softcap is None
        and biased_attention.serves(q, k, v, bias)
    )
    padded_only = softcap is not None or (bias is not None and not biased_kernel)
    if meta.static and not (meta.use_varlen and not padded_only):
        raise GraphUnsupported(
            "its attention needs the padded fallback (soft-capping, an additive bias, or no "
            "varlen kernel)"
        )
    if bias is not None and (softcap is not None or meta.kv is not None):
        raise NotImplementedError("an attention bias with soft-capping or chunked prompts")
    if meta.kv is not None:
        if torch.compiler.is_compiling():
            return torch.ops.vecpool.cached_attention(q, k, v, causal, scale, window, softcap)
        return _cached_attention(
            q, k, v, meta, causal=causal, scale=scale, window=window, softcap=softcap
        )
    if biased_kernel:
        assert bias is not None
        return biased_attention.biased_attention(
            q, k, v, meta.cu_seqlens, meta.max_seqlen, bias, scale
        )
    if meta.use_varlen and not padded_only:
        if (
            meta.packed
            and meta.key_rows is None
            and bias is None
            and (window is None or window >= meta.max_seqlen)  # no window within a sequence
            and packed_attention.serves(q, k, v)
        ):
            return packed_attention.packed_attention(q, k, v, meta.cu_seqlens, causal, scale)
        cu_k, max_k = meta.cu_seqlens, meta.max_seqlen
        if meta.key_rows is not None:
            # Keys cut short only where every query sees every key (ColBERT's encoders):
            # causal or windowed attention would align the two lengths differently.
            assert meta.cu_seqlens_k is not None and not causal and window is None
            k, v = k[meta.key_rows], v[meta.key_rows]
            cu_k, max_k = meta.cu_seqlens_k, meta.max_seqlen_k
        return _flash_attention(
            q, k, v, meta, cu_k, max_k, causal=causal, scale=scale, window=window
        )
    if (
        meta.cpu_attention != "padded"
        and not meta.batch_invariant
        and meta.key_rows is None
        and bias is None
        and softcap is None
        and (window is None or window >= meta.max_seqlen)
        and not torch.compiler.is_compiling()
    ):
        return _cpu_attention(q, k, v, meta, causal=causal, scale=scale)
    return _padded_attention(
        q,
        k,
        v,
        meta,
        meta.seq_ids,
        meta.pos_in_seq,
        meta.max_seqlen,
        causal=causal,
        scale=scale,
        window=window,
        softcap=softcap,
        bias=bias,
    )


def _cpu_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    meta: AttentionMetadata,
    *,
    causal: bool,
    scale: float,
) -> torch.Tensor:
    """The step's plain attention by groups of lengths or by sequence (`cpu_attention.py`)."""
    if meta.cpu_attention == "sequences":
        bounds = meta.cu_seqlens.tolist()
        return cpu_attention.sequence_attention(q, k, v, bounds, causal=causal, scale=scale)
    if meta._buckets is None:
        cu = meta.cu_seqlens.cpu().numpy().astype(np.int64)
        meta._buckets = cpu_attention.bucket_plan(cu, q.device, meta.cpu_group_cost)
    return cpu_attention.bucketed_attention(q, k, v, meta._buckets, causal=causal, scale=scale)


# Not traced by torch.compile, as `torch.compiler.disable` would have it (one graph break at the
# call); torch's lazy form, because the decorator itself imports torch._dynamo (about a second at
# every process start, which a process that never compiles need not pay).
@torch._disable_dynamo
def _cached_attention(
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
    """Attention of chunks with their cached positions. It writes the runner's buffers, so it
    runs outside compiled graphs: compiled blocks call it through `vecpool::cached_attention`."""
    kv = meta.kv
    assert kv is not None
    shared = kv.prefix.shared if kv.prefix is not None else None
    if shared is not None and meta.use_varlen and softcap is None and window is None:
        own_k, own_v, prefix_k, prefix_v = kv.extend_shared(k, v)
        return split_attention.shared_prefix_attention(
            q,
            (own_k, own_v, meta.cu_seqlens, meta.max_seqlen),
            (prefix_k, prefix_v),
            shared,
            causal=causal,
            scale=scale,
        )
    if meta.static or (kv.prefix is not None and kv.prefix.shared_only):
        raise GraphUnsupported("a layer attends to cached keys by copying them (a window)")
    k, v = kv.extend(k, v)
    if meta.use_varlen and softcap is None:
        return _flash_attention(
            q,
            k,
            v,
            meta,
            kv.cu_seqlens_k,
            kv.max_seqlen_k,
            causal=causal,
            scale=scale,
            window=window,
        )
    return _padded_attention(
        q,
        k,
        v,
        meta,
        kv.key_seq_ids,
        kv.key_pos,
        kv.max_seqlen_k,
        causal=causal,
        scale=scale,
        window=window,
        softcap=softcap,
    )


# The step whose cached attention `vecpool::cached_attention` serves: a compiled graph passes
# tensors and numbers to an op, not the step's `ChunkedKV`, so the model runner binds the step
# around its forward (`cached_step`) and the op reads it here.
_CACHED_STEP: ContextVar[AttentionMetadata | None] = ContextVar("cached_step", default=None)


@contextlib.contextmanager
def cached_step(meta: AttentionMetadata) -> Iterator[None]:
    """Bind `meta` as the step whose chunked / cached attention compiled layers call."""
    token = _CACHED_STEP.set(meta)
    try:
        yield
    finally:
        _CACHED_STEP.reset(token)


@torch.library.custom_op("vecpool::cached_attention", mutates_args=())
def _cached_attention_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool,
    scale: float,
    window: int | None,
    softcap: float | None,
) -> torch.Tensor:
    """`_cached_attention` of the bound step, for compiled layers. It writes the step's key and
    value buffers (state the compiler does not see): each layer calls it once, in layer order,
    which the data dependence between layers keeps."""
    meta = _CACHED_STEP.get()
    if meta is None or meta.kv is None:
        raise RuntimeError("cached attention called outside a step bound with `cached_step`")
    out = _cached_attention(
        q, k, v, meta, causal=causal, scale=scale, window=window, softcap=softcap
    )
    return out.contiguous()


@_cached_attention_op.register_fake
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *options: object) -> torch.Tensor:
    return q.new_empty((q.shape[0], q.shape[1], v.shape[2]))  # the op's output, its shape


def _flash_attention(
    q: torch.Tensor,
    k: torch.Tensor,  # [num_keys, num_kv_heads, head_dim]
    v: torch.Tensor,
    meta: AttentionMetadata,
    cu_k: torch.Tensor,  # [num_seqs + 1] int32: key boundaries
    max_k: int,
    *,
    causal: bool,
    scale: float,
    window: int | None,
) -> torch.Tensor:
    kernel = _varlen if _varlen is not None else _varlen_kernel()
    assert kernel is not None  # guarded by varlen_available when the runner chose it
    varlen_attn, has_gqa = kernel
    # FlashAttention aligns a causal mask and a window to the end of the keys when a sequence
    # has fewer queries than keys: query i of q sees keys up to i + n_k - n_q.
    left = -1 if window is None else window - 1
    right = 0 if causal else left
    extra: dict[str, Any] = {}
    if k.shape[1] != q.shape[1]:
        if has_gqa:
            extra["enable_gqa"] = True
        else:
            return _flash_gqa(
                q, k, v, meta.cu_seqlens, cu_k, meta.max_seqlen, max_k, scale, left, right
            )
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


def _flash_gqa(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k: torch.Tensor,  # [num_keys, num_kv_heads, head_dim], num_heads a multiple of num_kv_heads
    v: torch.Tensor,
    cu_q: torch.Tensor,  # [num_seqs + 1] int32
    cu_k: torch.Tensor,  # [num_seqs + 1] int32
    max_q: int,
    max_k: int,
    scale: float,
    left: int,
    right: int,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """Grouped-query attention without expanding the keys and values, on a torch whose
    `varlen_attn` takes no `enable_gqa` (2.11): the FlashAttention kernel underneath reads each
    query head's key/value head itself; `varlen_attn` only refuses unequal head counts."""
    # (left, right) is (-1 or a window, 0) causal, (window, window) not: one left and whether
    # causal say it.
    out, _ = split_attention.attention_with_lse(
        q, k, v, cu_q, cu_k, max_q, max_k, scale=scale, causal=right == 0, window_left=left
    )
    return out


def _padded_attention(
    q: torch.Tensor,
    k: torch.Tensor,  # [num_keys, num_kv_heads, head_dim]
    v: torch.Tensor,
    meta: AttentionMetadata,
    key_seq_ids: torch.Tensor,  # [num_keys] int64: each key row's sequence
    key_pos: torch.Tensor,  # [num_keys] int64: its position among the sequence's keys
    max_k: int,
    *,
    causal: bool,
    scale: float,
    window: int | None,
    softcap: float | None,
    bias: torch.Tensor | None = None,  # [1 or num_seqs, num_heads, max_seqlen, max_k]
) -> torch.Tensor:
    num_seqs = meta.num_seqs
    # Each row's place in the padded layout seen as `[B * L, H, D]`: whole rows move with
    # `index_copy_` / `index_select` on the first dimension (contiguous copies of H * D values),
    # several times faster on the CPU than an index_put over (sequence, position) pairs.
    q_rows = meta.seq_ids * meta.max_seqlen + meta.pos_in_seq  # [num_tokens]

    def to_padded(
        name: str, x: torch.Tensor, rows: torch.Tensor, length: int
    ) -> torch.Tensor:  # [T, H, D] -> [B, H, L, D]
        padded = meta.padded_buffer(name, torch.Size((num_seqs, length, *x.shape[1:])), x)
        padded.view(num_seqs * length, *x.shape[1:]).index_copy_(0, rows, x)
        return padded.transpose(1, 2)

    joint = None
    if key_seq_ids is meta.seq_ids and not meta.batch_invariant:
        joint = _joint_rows(q, k, v)
    if joint is not None:  # one copy moves all three: q, k and v are its heads in order
        shape = torch.Size((num_seqs, meta.max_seqlen, joint.shape[1]))
        padded = meta.padded_buffer("qkv", shape, joint)
        padded.view(num_seqs * meta.max_seqlen, -1).index_copy_(0, q_rows, joint)
        num_q, num_kv = q.shape[1], k.shape[1]
        heads = padded.view(*shape[:2], num_q + 2 * num_kv, q.shape[2]).transpose(1, 2)
        qp, kp, vp = heads.split([num_q, num_kv, num_kv], dim=1)  # [B, heads, L, D] each
    else:
        qp = to_padded("q", q, q_rows, meta.max_seqlen)
        k_rows = q_rows if key_seq_ids is meta.seq_ids else key_seq_ids * max_k + key_pos
        kp = to_padded("k", k, k_rows, max_k)
        vp = to_padded("v", v, k_rows, max_k)
    if kp.shape[1] != qp.shape[1]:
        group = qp.shape[1] // kp.shape[1]
        kp = kp.repeat_interleave(group, dim=1)
        vp = vp.repeat_interleave(group, dim=1)
    mask = meta.padded_mask(causal, window)  # [B, 1, Lq, Lk]
    if meta.batch_invariant:
        out = invariant.padded_attention(qp, kp, vp, mask, scale=scale, softcap=softcap, bias=bias)
    elif bias is not None:  # additive: the bias where attended, -inf elsewhere
        float_mask = meta.additive_mask(bias, mask, qp.dtype)
        out = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=float_mask, scale=scale)
    elif softcap is None:
        out = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=mask, scale=scale)
    else:
        scores = torch.matmul(qp, kp.transpose(-1, -2)) * scale
        scores = torch.tanh(scores / softcap) * softcap
        scores = scores.masked_fill(~mask, float("-inf"))
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(qp.dtype)
        out = torch.matmul(probs, vp)
    # [B, H, L, D] -> [B * L, H, D]: a view where the kernel wrote `[B, L, H, D]` (the CPU's
    # flash kernel does), else one copy; then the rows of real tokens.
    num_heads, head_dim = out.shape[1], out.shape[3]
    out = out.transpose(1, 2).reshape(num_seqs * meta.max_seqlen, num_heads, head_dim)
    return out.index_select(0, q_rows)
