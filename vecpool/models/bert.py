"""BERT-family encoders (BERT, RoBERTa, XLM-RoBERTa): bidirectional, post-norm, absolute positions."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from vecpool.errors import ConfigError
from vecpool.models.attention import AttentionMetadata, flat_attention
from vecpool.models.base import PoolingModel
from vecpool.models.layers import activation


@dataclass(frozen=True)
class BertConfig:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int
    hidden_act: str
    max_position_embeddings: int
    type_vocab_size: int
    layer_norm_eps: float
    position_offset: int  # RoBERTa numbers positions from padding_idx + 1

    @classmethod
    def from_hf(cls, hf: dict[str, Any], position_offset: int = 0) -> BertConfig:
        if hf.get("position_embedding_type", "absolute") != "absolute":
            raise ConfigError(
                f"position_embedding_type {hf['position_embedding_type']!r} is not supported"
            )
        return cls(
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=hf["num_attention_heads"],
            intermediate_size=hf["intermediate_size"],
            hidden_act=hf.get("hidden_act", "gelu"),
            max_position_embeddings=hf["max_position_embeddings"],
            type_vocab_size=hf.get("type_vocab_size", 2),
            layer_norm_eps=hf.get("layer_norm_eps", 1e-12),
            position_offset=position_offset,
        )


class BertEmbeddings(nn.Module):
    def __init__(self, c: BertConfig):
        super().__init__()
        self.word_embeddings = nn.Embedding(c.vocab_size, c.hidden_size)
        self.position_embeddings = nn.Embedding(c.max_position_embeddings, c.hidden_size)
        self.token_type_embeddings = nn.Embedding(c.type_vocab_size, c.hidden_size)
        self.LayerNorm = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps)
        self.position_offset = c.position_offset

    def forward(
        self, inputs_embeds: torch.Tensor, positions: torch.Tensor, token_type_ids: torch.Tensor
    ) -> torch.Tensor:
        # Same order of additions as the reference, so that results match to the last bit.
        x = inputs_embeds + self.token_type_embeddings(token_type_ids)
        x = x + self.position_embeddings(positions + self.position_offset)
        return self.LayerNorm(x)


class BertSelfAttention(nn.Module):
    def __init__(self, c: BertConfig):
        super().__init__()
        self.num_heads = c.num_heads
        self.head_dim = c.hidden_size // c.num_heads
        self.query = nn.Linear(c.hidden_size, c.hidden_size)
        self.key = nn.Linear(c.hidden_size, c.hidden_size)
        self.value = nn.Linear(c.hidden_size, c.hidden_size)

    def forward(self, x: torch.Tensor, attn: AttentionMetadata) -> torch.Tensor:
        shape = (x.shape[0], self.num_heads, self.head_dim)
        q, k, v = self.query(x).view(shape), self.key(x).view(shape), self.value(x).view(shape)
        out = flat_attention(q, k, v, attn, causal=False, scale=self.head_dim**-0.5)
        return out.reshape(x.shape[0], -1)


class BertDenseNorm(nn.Module):
    """`LayerNorm(dense(x) + residual)`: the post-norm output of attention and of the MLP."""

    def __init__(self, in_features: int, c: BertConfig):
        super().__init__()
        self.dense = nn.Linear(in_features, c.hidden_size)
        self.LayerNorm = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.dense(x) + residual)


class BertAttention(nn.Module):
    def __init__(self, c: BertConfig):
        super().__init__()
        self.self = BertSelfAttention(c)
        self.output = BertDenseNorm(c.hidden_size, c)

    def forward(self, x: torch.Tensor, attn: AttentionMetadata) -> torch.Tensor:
        return self.output(self.self(x, attn), x)


class BertIntermediate(nn.Module):
    def __init__(self, c: BertConfig):
        super().__init__()
        self.dense = nn.Linear(c.hidden_size, c.intermediate_size)
        self.act = activation(c.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.dense(x))


class BertLayer(nn.Module):
    def __init__(self, c: BertConfig):
        super().__init__()
        self.attention = BertAttention(c)
        self.intermediate = BertIntermediate(c)
        self.output = BertDenseNorm(c.intermediate_size, c)

    def forward(self, x: torch.Tensor, attn: AttentionMetadata) -> torch.Tensor:
        x = self.attention(x, attn)
        return self.output(self.intermediate(x), x)


class BertEncoder(nn.Module):
    def __init__(self, c: BertConfig):
        super().__init__()
        self.layer = nn.ModuleList(BertLayer(c) for _ in range(c.num_layers))


class BertModel(PoolingModel):
    checkpoint_prefixes = ("bert.",)
    unused_checkpoint_keys = ("pooler.*", "embeddings.position_ids", "embeddings.token_type_ids")
    is_causal = False
    uses_token_type_ids = True

    def __init__(self, c: BertConfig):
        super().__init__()
        self.config = c
        self.hidden_size = c.hidden_size
        self.vocab_size = c.vocab_size
        self.max_positions = c.max_position_embeddings - c.position_offset
        self.embeddings = BertEmbeddings(c)
        self.encoder = BertEncoder(c)

    @classmethod
    def from_hf_config(cls, hf: dict[str, Any]) -> PoolingModel:
        return cls(BertConfig.from_hf(hf))

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embeddings.word_embeddings(input_ids)

    def forward(
        self,
        inputs_embeds: torch.Tensor,
        positions: torch.Tensor,
        attn: AttentionMetadata,
        token_type_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if token_type_ids is None:
            token_type_ids = torch.zeros_like(positions)
        x = self.embeddings(inputs_embeds, positions, token_type_ids)
        for layer in self.encoder.layer:
            x = layer(x, attn)
        return x


class RobertaModel(BertModel):
    """RoBERTa / XLM-RoBERTa: BERT with positions counted from `pad_token_id + 1`."""

    checkpoint_prefixes = ("roberta.",)

    @classmethod
    def from_hf_config(cls, hf: dict[str, Any]) -> PoolingModel:
        return cls(BertConfig.from_hf(hf, position_offset=int(hf.get("pad_token_id", 1)) + 1))
