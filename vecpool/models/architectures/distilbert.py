"""DistilBERT encoders (msmarco-distilbert, multi-qa-distilbert, SPLADE distil models, many
classifiers): BERT's post-norm layers under other names, absolute positions, no token types.

Its config names the sizes `dim`, `n_layers`, `n_heads`, `hidden_dim` and the activation
`activation`; its layer norms have a fixed eps of 1e-12.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import nn

from vecpool.models.architectures.bert import BertConfig, BertEmbeddings
from vecpool.models.architectures.encoder import EncoderModel
from vecpool.models.architectures.encoder_heads import (
    LMHeadNames,
    MaskedLM,
    PooledSequenceClassifier,
    TokenClassifier,
)
from vecpool.models.base import PoolingModel, hf_num_labels
from vecpool.models.hf import hf_get
from vecpool.models.layers.attention import AttentionMetadata
from vecpool.models.layers.basic import activation
from vecpool.models.layers.encoder_blocks import FusedSelfAttention

_LAYER_NORM_EPS = 1e-12  # fixed in transformers' DistilBERT, not read from the config


def distilbert_config(hf: dict[str, Any]) -> BertConfig:
    """The layer sizes of a DistilBERT `config.json`, in the BERT layers' config."""
    return BertConfig(
        vocab_size=hf["vocab_size"],
        hidden_size=hf_get(hf, "dim", "hidden_size", default=768),
        num_layers=hf_get(hf, "n_layers", "num_hidden_layers", default=6),
        num_heads=hf_get(hf, "n_heads", "num_attention_heads", default=12),
        intermediate_size=hf_get(hf, "hidden_dim", default=3072),
        hidden_act=hf_get(hf, "activation", default="gelu"),
        max_position_embeddings=hf_get(hf, "max_position_embeddings", default=512),
        type_vocab_size=0,  # no token types
        layer_norm_eps=_LAYER_NORM_EPS,
        position_offset=0,
        num_labels=hf_num_labels(hf),
    )


class DistilBertSelfAttention(FusedSelfAttention):
    """`q_lin`, `k_lin`, `v_lin`, then `out_lin`."""

    qkv_names = ("q_lin", "k_lin", "v_lin")
    out_name = "out_lin"


class DistilBertFFN(nn.Module):
    def __init__(self, c: BertConfig):
        super().__init__()
        self.lin1 = nn.Linear(c.hidden_size, c.intermediate_size)
        self.lin2 = nn.Linear(c.intermediate_size, c.hidden_size)
        self.act = activation(c.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin2(self.act(self.lin1(x)))


class DistilBertBlock(nn.Module):
    """transformers' `TransformerBlock`: attention, norm, feed-forward, norm (post-norm)."""

    def __init__(self, c: BertConfig):
        super().__init__()
        self.attention = DistilBertSelfAttention(c)
        self.sa_layer_norm = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps)
        self.ffn = DistilBertFFN(c)
        self.output_layer_norm = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps)

    def forward(self, x: torch.Tensor, attn: AttentionMetadata) -> torch.Tensor:
        x = self.sa_layer_norm(self.attention(x, attn) + x)
        return self.output_layer_norm(self.ffn(x) + x)


class DistilBertTransformer(nn.Module):
    def __init__(self, c: BertConfig):
        super().__init__()
        self.layer = nn.ModuleList(DistilBertBlock(c) for _ in range(c.num_layers))


class DistilBertModel(EncoderModel):
    """The bare DistilBERT encoder."""

    checkpoint_prefixes = ("distilbert.",)
    unused_checkpoint_keys: ClassVar[tuple[str, ...]] = ("embeddings.position_ids",)

    def __init__(self, c: BertConfig):
        super().__init__(c, c.max_position_embeddings)
        self.config = c
        # Positions learned or sinusoidal (`sinusoidal_pos_embds`): either way a stored table.
        self.embeddings = BertEmbeddings(c)
        self.transformer = DistilBertTransformer(c)

    @classmethod
    def from_hf_config(cls, hf: dict[str, Any]) -> PoolingModel:
        return cls(distilbert_config(hf))

    def layer_stack(self) -> nn.ModuleList:
        return self.transformer.layer


class DistilBertForSequenceClassification(PooledSequenceClassifier, DistilBertModel):
    """The first row through `pre_classifier`, relu, `classifier`."""

    classifier_names = ("pre_classifier", "classifier")
    classifier_act = "relu"


class DistilBertForTokenClassification(TokenClassifier, DistilBertModel):
    """`classifier` on every token row."""


class DistilBertForMaskedLM(MaskedLM, DistilBertModel):
    """DistilBERT with its masked-LM head: `vocab_transform`, the config's activation,
    `vocab_layer_norm`, `vocab_projector` (tied: the word embeddings, with its own bias)."""

    lm_names = LMHeadNames(
        dense="vocab_transform", norm="vocab_layer_norm", decoder="vocab_projector"
    )
    tied_weights = lm_names.ties()
