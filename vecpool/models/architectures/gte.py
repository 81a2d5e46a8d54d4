"""GTE "new" (Alibaba-NLP's `NewModel`, `model_type: new`): gte-base-en-v1.5, gte-large-en-v1.5,
gte-multilingual-base and its reranker.

A post-norm BERT-like encoder with rotary positions (optionally NTK-scaled, `rope_scaling`
type "ntk"), a packed `qkv_proj` with biases, and a gated MLP (`up_gate_proj` holds the up and
gate halves, `down_proj`). Token types are added where `type_vocab_size > 0`. The checkpoint's
`unpad_inputs` only chooses how the reference pads; flat batches are unpadded anyway. The
published code lives in the model repositories (remote code); this is written from it and never
runs it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from vecpool.errors import ConfigError
from vecpool.models.architectures.encoder import EncoderModel
from vecpool.models.architectures.encoder_heads import PooledSequenceClassifier
from vecpool.models.base import PoolingModel, hf_num_labels
from vecpool.models.layers.attention import AttentionMetadata
from vecpool.models.layers.basic import Rotary, activation
from vecpool.models.layers.encoder_blocks import packed_rotary_attention


@dataclass(frozen=True)
class GteConfig:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int
    hidden_act: str
    max_position_embeddings: int
    type_vocab_size: int
    layer_norm_eps: float
    rope_theta: float
    ntk_factor: float | None  # rope_scaling {"type": "ntk", "factor": ...}
    ntk_mixed_b: float | None  # its optional "mixed_b"
    num_labels: int

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> GteConfig:
        unsupported = {
            "position_embedding_type": (hf.get("position_embedding_type", "rope"), "rope"),
            "layer_norm_type": (hf.get("layer_norm_type", "layer_norm"), "layer_norm"),
            "pack_qkv": (hf.get("pack_qkv", True), True),
            "logn_attention_scale": (hf.get("logn_attention_scale", False), False),
        }
        for key, (value, supported) in unsupported.items():
            if value != supported:
                raise ConfigError(f"GTE {key}={value!r} is not supported (only {supported!r})")
        factor = mixed_b = None
        scaling = hf.get("rope_scaling")
        if scaling:
            kind = scaling.get("type", scaling.get("rope_type"))
            if kind != "ntk":
                raise ConfigError(f"GTE rope_scaling type {kind!r} is not supported (ntk)")
            factor = float(scaling["factor"])
            mixed_b = None if scaling.get("mixed_b") is None else float(scaling["mixed_b"])
        hidden, heads = int(hf["hidden_size"]), int(hf["num_attention_heads"])
        if hidden % heads:
            raise ConfigError(
                f"hidden_size={hidden} is not a multiple of num_attention_heads={heads}"
            )
        return cls(
            vocab_size=int(hf["vocab_size"]),
            hidden_size=hidden,
            num_layers=int(hf["num_hidden_layers"]),
            num_heads=heads,
            intermediate_size=int(hf["intermediate_size"]),
            hidden_act=str(hf.get("hidden_act", "gelu")),
            max_position_embeddings=int(hf.get("max_position_embeddings", 512)),
            type_vocab_size=int(hf.get("type_vocab_size", 0)),
            layer_norm_eps=float(hf.get("layer_norm_eps", 1e-12)),
            rope_theta=float(hf.get("rope_theta", 10000.0)),
            ntk_factor=factor,
            ntk_mixed_b=mixed_b,
            num_labels=hf_num_labels(hf),
        )


def gte_rotary(c: GteConfig) -> Rotary:
    """The rotary table of the reference's `RotaryEmbedding`, or its `NTKScalingRotaryEmbedding`.

    NTK scaling takes effect whenever the factor exceeds 1 (the reference builds its table for
    `max_position_embeddings * factor` positions at start): without `mixed_b`, frequencies of a
    base `theta * factor` divided by `factor ** (2 / head_dim)`; with it, the base frequencies
    divided by `exp(a * m ** mixed_b)`, `a = log(factor) / (head_dim / 2) ** mixed_b`.
    """
    dim = c.head_dim
    factor = c.ntk_factor if c.ntk_factor is not None and c.ntk_factor > 1 else None
    theta = c.rope_theta * factor if factor is not None and c.ntk_mixed_b is None else c.rope_theta
    rotary = Rotary(dim, {"rope_theta": theta})
    if factor is not None and c.ntk_mixed_b is None:
        rotary.inv_freq = rotary.inv_freq / factor ** (2 / dim)
    elif factor is not None and c.ntk_mixed_b is not None:
        a = torch.tensor(factor, device="cpu").log() / (dim / 2) ** c.ntk_mixed_b
        m = torch.arange(1, dim // 2 + 1, dtype=torch.int64, device="cpu").float()
        rotary.inv_freq = rotary.inv_freq / (a * m**c.ntk_mixed_b).exp()
    return rotary


class NewEmbeddings(nn.Module):
    def __init__(self, c: GteConfig):
        super().__init__()
        self.word_embeddings = nn.Embedding(c.vocab_size, c.hidden_size)
        self.token_type_embeddings: nn.Embedding | None = None
        if c.type_vocab_size > 0:
            self.token_type_embeddings = nn.Embedding(c.type_vocab_size, c.hidden_size)
        self.LayerNorm = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps)

    def forward(self, inputs_embeds: torch.Tensor, token_type_ids: torch.Tensor) -> torch.Tensor:
        x = inputs_embeds
        if self.token_type_embeddings is not None:
            x = x + self.token_type_embeddings(token_type_ids)
        return self.LayerNorm(x)


class NewAttention(nn.Module):
    def __init__(self, c: GteConfig):
        super().__init__()
        self.num_heads = c.num_heads
        self.qkv_proj = nn.Linear(c.hidden_size, 3 * c.hidden_size)
        self.o_proj = nn.Linear(c.hidden_size, c.hidden_size)

    def forward(
        self,
        x: torch.Tensor,  # [num_tokens, hidden]
        cos: torch.Tensor,  # [num_tokens, head_dim]
        sin: torch.Tensor,
        attn: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, hidden]
        out = packed_rotary_attention(self.qkv_proj(x), cos, sin, attn, self.num_heads)
        return self.o_proj(out)


class NewGatedMLP(nn.Module):
    """`down_proj(act(gate) * up)`, up and gate the two halves of `up_gate_proj(x)` (no bias)."""

    def __init__(self, c: GteConfig):
        super().__init__()
        self.up_gate_proj = nn.Linear(c.hidden_size, 2 * c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size)
        self.act = activation(c.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        up, gate = self.up_gate_proj(x).chunk(2, dim=-1)
        return self.down_proj(self.act(gate) * up)


class NewLayer(nn.Module):
    """Post-norm: `attn_ln(x + attention(x))`, then `mlp_ln(x + mlp(x))`."""

    def __init__(self, c: GteConfig):
        super().__init__()
        self.attention = NewAttention(c)
        self.mlp = NewGatedMLP(c)
        self.attn_ln = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps)
        self.mlp_ln = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: AttentionMetadata
    ) -> torch.Tensor:
        x = self.attn_ln(x + self.attention(x, cos, sin, attn))
        return self.mlp_ln(x + self.mlp(x))


class NewEncoder(nn.Module):
    def __init__(self, c: GteConfig):
        super().__init__()
        self.layer = nn.ModuleList(NewLayer(c) for _ in range(c.num_layers))


class NewModel(EncoderModel):
    """`embeddings`, `encoder`: the base model of a GTE "new" checkpoint."""

    checkpoint_prefixes = ("new.",)
    unused_checkpoint_keys: ClassVar[tuple[str, ...]] = ("pooler.*", "embeddings.position_ids")

    def __init__(self, c: GteConfig):
        super().__init__(c, c.max_position_embeddings, c.type_vocab_size)
        self.config = c
        self.rotary = gte_rotary(c)
        self.embeddings = NewEmbeddings(c)
        self.encoder = NewEncoder(c)

    @classmethod
    def from_hf_config(cls, hf: dict[str, Any]) -> PoolingModel:
        return cls(GteConfig.from_hf(hf))

    def encode(
        self,
        inputs_embeds: torch.Tensor,
        positions: torch.Tensor,
        attn: AttentionMetadata,
        token_type_ids: torch.Tensor,
    ) -> torch.Tensor:
        x = self.embeddings(inputs_embeds, token_type_ids)
        cos, sin = self.rotary.cos_sin(positions, x.dtype)
        for layer in self.encoder.layer:
            x = layer(x, cos, sin, attn)
        return x


class NewForSequenceClassification(PooledSequenceClassifier, NewModel):
    """The CLS row through `pooler` (dense, tanh), then `classifier` (gte-multilingual-reranker)."""

    unused_checkpoint_keys: ClassVar[tuple[str, ...]] = ("embeddings.position_ids",)
