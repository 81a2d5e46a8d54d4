"""Blocks the bidirectional encoder families share: BERT's post-norm `DenseNorm`, the lookup
of factorized embeddings padded to the hidden size, and self-attention over separate or packed
query/key/value projections.

Submodules keep the checkpoint's names: a family names its projections (`qkv_names`), so that
`encoder.layer.0.attention.self.query.weight` or `transformer.layer.0.attention.q_lin.weight`
loads unchanged.
"""

from __future__ import annotations

from typing import ClassVar, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from vecpool.models.layers.attention import AttentionMetadata, flat_attention
from vecpool.models.layers.basic import FusedProjections, apply_rotary, fuse, linear_residual


class NormSizes(Protocol):
    """What `DenseNorm` reads from a family's config."""

    @property
    def hidden_size(self) -> int: ...

    @property
    def layer_norm_eps(self) -> float: ...


class AttentionSizes(Protocol):
    """What an attention block reads from a family's config."""

    @property
    def hidden_size(self) -> int: ...

    @property
    def num_heads(self) -> int: ...


class LayerSizes(NormSizes, AttentionSizes, Protocol):
    """What BERT's layer reads from a family's config (MPNet's, DeBERTa-v2's are alike)."""

    @property
    def intermediate_size(self) -> int: ...

    @property
    def hidden_act(self) -> str: ...


class DenseNorm(nn.Module):
    """`LayerNorm(dense(x) + residual)`: BERT's post-norm output of attention and of the MLP
    (BERT, MPNet, DeBERTa-v2, Jina BERT), the add done by the linear where it can."""

    def __init__(self, in_features: int, c: NormSizes):
        super().__init__()
        self.dense = nn.Linear(in_features, c.hidden_size)
        self.LayerNorm = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(linear_residual(self.dense, x, residual))


def pad_to_hidden(rows: torch.Tensor, hidden_size: int) -> torch.Tensor:
    """`[n, embedding_size]` -> `[n, hidden_size]`: zero columns after a factorized lookup's
    own (ALBERT, ELECTRA, DeBERTa-v2), as the engine's input rows are hidden-size wide and
    prompt embeds take the same layout."""
    extra = hidden_size - rows.shape[-1]
    return F.pad(rows, (0, extra)) if extra else rows


def bidirectional_attention(
    q: torch.Tensor,  # [num_tokens, heads, head_dim]
    k: torch.Tensor,
    v: torch.Tensor,
    attn: AttentionMetadata,
    bias: torch.Tensor | None = None,  # [1, heads, max_seqlen, max_seqlen], added to the logits
    window: int | None = None,  # `flat_attention`'s (None: the whole sequence)
) -> torch.Tensor:  # [num_tokens, heads * head_dim]
    """Attention of every token to every token of its sequence (within `window`), scaled by
    `head_dim ** -0.5`."""
    scale = q.shape[-1] ** -0.5
    out = flat_attention(q, k, v, attn, causal=False, scale=scale, window=window, bias=bias)
    return out.reshape(q.shape[0], -1)


class FusedSelfAttention(nn.Module):
    """Bidirectional self-attention whose query, key and value are three biased linears over
    the same input, named as the checkpoint names them (`qkv_names`); once the weights load,
    `fuse_projections` joins them into the one matmul `qkv`. The output projection is this
    module's where the family keeps it here (`out_name`: MPNet's `o`, DistilBERT's `out_lin`);
    elsewhere the family applies its own (BERT's `output.dense`)."""

    qkv_names: ClassVar[tuple[str, str, str]] = ("query", "key", "value")
    out_name: ClassVar[str | None] = None

    def __init__(self, c: AttentionSizes):
        super().__init__()
        self.num_heads = c.num_heads
        self.head_dim = c.hidden_size // c.num_heads
        for name in self.qkv_names:
            setattr(self, name, nn.Linear(c.hidden_size, c.hidden_size))
        if self.out_name is not None:
            setattr(self, self.out_name, nn.Linear(c.hidden_size, c.hidden_size))
        self.qkv: FusedProjections | None = None

    def fuse_projections(self) -> None:
        fuse(self, "qkv", list(self.qkv_names))

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """`[num_tokens, hidden]` -> q, k, v, each `[num_tokens, hidden]`."""
        assert self.qkv is not None, "projections are fused when the weights load"
        return self.qkv(x)

    def attend(
        self,
        q: torch.Tensor,  # [num_tokens, hidden]
        k: torch.Tensor,
        v: torch.Tensor,
        attn: AttentionMetadata,
        bias: torch.Tensor | None = None,
    ) -> torch.Tensor:  # [num_tokens, hidden]
        shape = (q.shape[0], self.num_heads, self.head_dim)
        return bidirectional_attention(
            q.reshape(shape), k.reshape(shape), v.reshape(shape), attn, bias
        )

    def forward(
        self, x: torch.Tensor, attn: AttentionMetadata, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        q, k, v = self.project(x)
        out = self.attend(q, k, v, attn, bias)
        return out if self.out_name is None else getattr(self, self.out_name)(out)


def packed_rotary_attention(
    packed: torch.Tensor,  # [num_tokens, 3 * hidden]: q, k, v side by side
    cos: torch.Tensor,  # [num_tokens, head_dim]
    sin: torch.Tensor,
    attn: AttentionMetadata,
    num_heads: int,
    window: int | None = None,
) -> torch.Tensor:  # [num_tokens, hidden]
    """Bidirectional attention (within `window`) over one packed q|k|v projection, rotary on q
    and k (GPT-NeoX halves), as GTE's `qkv_proj`, NomicBERT's and ModernBERT's `Wqkv` lay them
    out."""
    n = packed.shape[0]
    head_dim = packed.shape[1] // (3 * num_heads)
    q, k, v = packed.view(n, 3, num_heads, head_dim).unbind(dim=1)
    q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
    return bidirectional_attention(q, k, v, attn, window=window)


class PackedRotaryAttention(nn.Module):
    """`packed_rotary_attention` between the checkpoint's two projections, under its names:
    the packed q|k|v (`qkv_name`) and the output (`out_name`). `window`: each token attends
    within it (None: the whole sequence)."""

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        names: tuple[str, str],  # (qkv_name, out_name)
        biases: tuple[bool, bool],  # of the q|k|v and the output projection
        window: int | None = None,
    ):
        super().__init__()
        self.num_heads, self.window = num_heads, window
        self.qkv_name, self.out_name = names
        self.add_module(self.qkv_name, nn.Linear(hidden_size, 3 * hidden_size, bias=biases[0]))
        self.add_module(self.out_name, nn.Linear(hidden_size, hidden_size, bias=biases[1]))

    def forward(
        self,
        x: torch.Tensor,  # [num_tokens, hidden]
        cos: torch.Tensor,  # [num_tokens, head_dim]
        sin: torch.Tensor,
        attn: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, hidden]
        qkv, out = getattr(self, self.qkv_name), getattr(self, self.out_name)
        return out(packed_rotary_attention(qkv(x), cos, sin, attn, self.num_heads, self.window))
