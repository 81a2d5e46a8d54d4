"""ALBERT encoders (paraphrase-albert-small-v2): factorized embeddings (`embedding_size` wide,
mapped to the hidden size by `embedding_hidden_mapping_in`) and layer weights shared across the
depth: `num_hidden_groups` groups of `inner_group_num` layers, layer `i` of `num_hidden_layers`
running group `int(i / (num_hidden_layers / num_hidden_groups))`, as transformers does.

As for ELECTRA, the word embedding lookup fills the first `embedding_size` columns of a
hidden-size input row (see `vecpool.models.architectures.electra`).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, ClassVar

import torch
from torch import nn

from vecpool.errors import ConfigError
from vecpool.models.architectures.bert import (
    BertConfig,
    BertEmbeddings,
    BertSelfAttention,
)
from vecpool.models.architectures.electra import embedding_width
from vecpool.models.architectures.encoder import EncoderModel
from vecpool.models.architectures.encoder_heads import (
    LMHeadNames,
    MaskedLM,
    PooledSequenceClassifier,
    TokenClassifier,
)
from vecpool.models.base import PoolingModel
from vecpool.models.hf import hf_get
from vecpool.models.layers.attention import AttentionMetadata
from vecpool.models.layers.basic import activation


class AlbertAttention(BertSelfAttention):
    """BERT's self-attention (`query`, `key`, `value`) with its output `dense` and post-norm
    `LayerNorm` in the same module."""

    def __init__(self, c: BertConfig):
        super().__init__(c)
        self.dense = nn.Linear(c.hidden_size, c.hidden_size)
        self.LayerNorm = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps)

    def forward(
        self, x: torch.Tensor, attn: AttentionMetadata, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        return self.LayerNorm(x + self.dense(super().forward(x, attn, bias)))


class AlbertLayer(nn.Module):
    def __init__(self, c: BertConfig):
        super().__init__()
        self.attention = AlbertAttention(c)
        self.ffn = nn.Linear(c.hidden_size, c.intermediate_size)
        self.ffn_output = nn.Linear(c.intermediate_size, c.hidden_size)
        self.act = activation(c.hidden_act)
        self.full_layer_layer_norm = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps)

    def forward(self, x: torch.Tensor, attn: AttentionMetadata) -> torch.Tensor:
        x = self.attention(x, attn)
        return self.full_layer_layer_norm(self.ffn_output(self.act(self.ffn(x))) + x)


class AlbertLayerGroup(nn.Module):
    """`inner_group_num` layers run in order: the unit whose weights the depth shares."""

    def __init__(self, c: BertConfig, inner_group_num: int):
        super().__init__()
        self.albert_layers = nn.ModuleList(AlbertLayer(c) for _ in range(inner_group_num))

    def forward(self, x: torch.Tensor, attn: AttentionMetadata) -> torch.Tensor:
        for layer in self.albert_layers:
            x = layer(x, attn)
        return x


class AlbertTransformer(nn.Module):
    def __init__(self, c: BertConfig, embedding_size: int, groups: int, inner_group_num: int):
        super().__init__()
        self.embedding_hidden_mapping_in = nn.Linear(embedding_size, c.hidden_size)
        self.albert_layer_groups = nn.ModuleList(
            AlbertLayerGroup(c, inner_group_num) for _ in range(groups)
        )
        # The group each of the num_hidden_layers steps runs (transformers' float arithmetic).
        self.schedule = [int(i / (c.num_layers / groups)) for i in range(c.num_layers)]


class AlbertModel(EncoderModel):
    """The bare ALBERT encoder."""

    checkpoint_prefixes = ("albert.",)
    unused_checkpoint_keys: ClassVar[tuple[str, ...]] = (
        "pooler.*",
        "embeddings.position_ids",
        "embeddings.token_type_ids",
    )

    def __init__(self, c: BertConfig, embedding_size: int, groups: int, inner_group_num: int):
        super().__init__(c, c.max_position_embeddings, c.type_vocab_size)
        self.config = c
        self.embedding_size = embedding_size
        self.embeddings = BertEmbeddings(replace(c, hidden_size=embedding_size))
        self.encoder = AlbertTransformer(c, embedding_size, groups, inner_group_num)

    @classmethod
    def from_hf_config(cls, hf: dict[str, Any]) -> PoolingModel:
        return cls(*cls.albert_config(hf))

    @staticmethod
    def albert_config(hf: dict[str, Any]) -> tuple[BertConfig, int, int, int]:
        """(layer sizes, embedding_size, num_hidden_groups, inner_group_num) of a config."""
        c = BertConfig.from_hf({"hidden_act": "gelu_new", **hf})  # ALBERT's default activation
        groups = int(hf_get(hf, "num_hidden_groups", default=1))
        inner = int(hf_get(hf, "inner_group_num", default=1))
        if not 1 <= groups <= c.num_layers or inner < 1:
            raise ConfigError(
                f"ALBERT: num_hidden_groups {groups} must be within 1..num_hidden_layers "
                f"({c.num_layers}) and inner_group_num {inner} at least 1"
            )
        return c, embedding_width(hf, c.hidden_size, "ALBERT"), groups, inner

    def embed(
        self, inputs_embeds: torch.Tensor, positions: torch.Tensor, types: torch.Tensor | None
    ) -> torch.Tensor:
        x = self.embeddings(inputs_embeds[:, : self.embedding_size], positions, types)
        return self.encoder.embedding_hidden_mapping_in(x)  # [T, embedding_size] -> [T, hidden]

    def layer_stack(self) -> list[nn.Module]:
        groups = self.encoder.albert_layer_groups
        return [groups[group] for group in self.encoder.schedule]


class AlbertForSequenceClassification(PooledSequenceClassifier, AlbertModel):
    """The first row through ALBERT's `pooler` (a linear, then tanh), then `classifier`."""

    classifier_names = ("pooler", "classifier")


class AlbertForTokenClassification(TokenClassifier, AlbertModel):
    """`classifier` on every token row."""


class AlbertForMaskedLM(MaskedLM, AlbertModel):
    """ALBERT with its masked-LM head `predictions` (to the embedding width, then the tied
    decoder)."""

    lm_names = LMHeadNames.bert_layout("predictions")
    tied_weights = lm_names.ties()
