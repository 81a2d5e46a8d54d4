"""ELECTRA encoders (ms-marco-electra cross-encoders, ELECTRA discriminators): BERT's embeddings
and layers, with embeddings of their own width (`embedding_size`) projected to the hidden size
by `embeddings_project` when the two differ.

The engine's input rows are hidden-size wide, so when `embedding_size` is smaller the word
embedding lookup is written into the first `embedding_size` columns of a zero row (the rest is
ignored by `forward`); prompt embeds take the same layout. A wider `embedding_size` than the
hidden size (some generator checkpoints) is refused.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, ClassVar

import torch
from torch import nn

from vecpool.errors import ConfigError
from vecpool.models.architectures.bert import BertConfig, BertEmbeddings, BertEncoder
from vecpool.models.architectures.encoder import EncoderModel
from vecpool.models.architectures.encoder_heads import (
    HeadSequenceClassifier,
    LMHeadNames,
    MaskedLM,
    TokenClassifier,
)
from vecpool.models.base import PoolingModel
from vecpool.models.hf import hf_get


def embedding_width(hf: dict[str, Any], hidden_size: int, family: str) -> int:
    """A factorized model's `embedding_size`, which must not exceed its hidden size."""
    width = int(hf_get(hf, "embedding_size", default=hidden_size))
    if width > hidden_size:
        raise ConfigError(
            f"{family}: embedding_size {width} is larger than hidden_size {hidden_size}; vecpool "
            "serves factorized embeddings only up to the hidden size"
        )
    return width


class ElectraModel(EncoderModel):
    """The bare ELECTRA encoder (also the discriminator of `ElectraForPreTraining` folders)."""

    checkpoint_prefixes = ("electra.",)
    unused_checkpoint_keys: ClassVar[tuple[str, ...]] = (
        "embeddings.position_ids",
        "embeddings.token_type_ids",
    )

    def __init__(self, c: BertConfig, embedding_size: int):
        super().__init__(c, c.max_position_embeddings, c.type_vocab_size)
        self.config = c
        self.embedding_size = embedding_size
        self.embeddings = BertEmbeddings(replace(c, hidden_size=embedding_size))
        self.embeddings_project: nn.Linear | None = (
            nn.Linear(embedding_size, c.hidden_size) if embedding_size != c.hidden_size else None
        )
        self.encoder = BertEncoder(c)

    @classmethod
    def from_hf_config(cls, hf: dict[str, Any]) -> PoolingModel:
        c = BertConfig.from_hf(hf)
        return cls(c, embedding_width(hf, c.hidden_size, "ELECTRA"))

    def embed(
        self, inputs_embeds: torch.Tensor, positions: torch.Tensor, types: torch.Tensor | None
    ) -> torch.Tensor:
        x = self.embeddings(inputs_embeds[:, : self.embedding_size], positions, types)
        if self.embeddings_project is not None:
            x = self.embeddings_project(x)  # [T, embedding_size] -> [T, hidden]
        return x


class ElectraForSequenceClassification(HeadSequenceClassifier, ElectraModel):
    """The first row through `classifier`: dense, gelu (ELECTRA's choice, where RoBERTa has
    tanh), `out_proj` (ms-marco-electra cross-encoders)."""

    classifier_act = "gelu"


class ElectraForTokenClassification(TokenClassifier, ElectraModel):
    """`classifier` on every token row."""


class ElectraForMaskedLM(MaskedLM, ElectraModel):
    """The generator's masked-LM head: `generator_predictions` (dense to the embedding width,
    gelu, LayerNorm), then `generator_lm_head` (tied: the word embeddings, own bias). Exact
    gelu whatever `hidden_act` says, as transformers."""

    lm_names = LMHeadNames(
        dense="generator_predictions.dense",
        norm="generator_predictions.LayerNorm",
        decoder="generator_lm_head",
    )
    lm_act = "gelu"
    tied_weights = lm_names.ties()
