"""BERT-family encoders (BERT, RoBERTa, XLM-RoBERTa): bidirectional, post-norm, absolute positions.

Besides the base models: their sequence- and token-classification heads, their masked-LM heads
(SPLADE) and ColBERT's projection (`HF_ColBERT`), each a method the pooling runner applies to
the rows it selected.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from vecpool.errors import ConfigError
from vecpool.models.architectures.encoder import EncoderModel
from vecpool.models.architectures.encoder_heads import (
    HeadSequenceClassifier,
    MaskedLM,
    PooledSequenceClassifier,
    TokenClassifier,
)
from vecpool.models.base import Capability, PoolingModel, hf_num_labels
from vecpool.models.layers.attention import AttentionMetadata
from vecpool.models.layers.basic import (
    activation,
    activation_name,
    linear_activation,
)
from vecpool.models.layers.encoder_blocks import DenseNorm, FusedSelfAttention


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
    num_labels: int  # outputs of a classification head

    @classmethod
    def from_hf(cls, hf: dict[str, Any], position_offset: int = 0) -> BertConfig:
        if hf.get("position_embedding_type", "absolute") == "alibi":
            raise ConfigError(
                "position_embedding_type 'alibi' is Jina BERT v2: its folder's config.json "
                "should name JinaBertModel (or JinaBertForMaskedLM) in 'architectures'"
            )
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
            num_labels=hf_num_labels(hf),
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


class BertSelfAttention(FusedSelfAttention):
    """`query`, `key`, `value`; the output projection is `BertAttention.output`'s."""


class BertAttention(nn.Module):
    def __init__(self, c: BertConfig):
        super().__init__()
        self.self = BertSelfAttention(c)
        self.output = DenseNorm(c.hidden_size, c)

    def forward(self, x: torch.Tensor, attn: AttentionMetadata) -> torch.Tensor:
        return self.output(self.self(x, attn), x)


class BertIntermediate(nn.Module):
    def __init__(self, c: BertConfig):
        super().__init__()
        self.dense = nn.Linear(c.hidden_size, c.intermediate_size)
        self.act = activation_name(c.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear_activation(self.dense, x, self.act)


class BertLayer(nn.Module):
    def __init__(self, c: BertConfig):
        super().__init__()
        self.attention = BertAttention(c)
        self.intermediate = BertIntermediate(c)
        self.output = DenseNorm(c.intermediate_size, c)

    def forward(self, x: torch.Tensor, attn: AttentionMetadata) -> torch.Tensor:
        x = self.attention(x, attn)
        return self.output(self.intermediate(x), x)


class BertEncoder(nn.Module):
    def __init__(self, c: BertConfig):
        super().__init__()
        self.layer = nn.ModuleList(BertLayer(c) for _ in range(c.num_layers))


class BertModel(EncoderModel):
    checkpoint_prefixes = ("bert.",)
    # Older checkpoints (TensorFlow-era) name LayerNorm parameters gamma and beta.
    checkpoint_renames: ClassVar[dict[str, str]] = {
        "LayerNorm.gamma": "LayerNorm.weight",
        "LayerNorm.beta": "LayerNorm.bias",
    }
    unused_checkpoint_keys: ClassVar[tuple[str, ...]] = (
        "pooler.*",
        "embeddings.position_ids",
        "embeddings.token_type_ids",
    )

    def __init__(self, c: BertConfig):
        super().__init__(c, c.max_position_embeddings - c.position_offset, c.type_vocab_size)
        self.config = c
        self.embeddings = BertEmbeddings(c)
        self.encoder = BertEncoder(c)

    @classmethod
    def config_from_hf(cls, hf: dict[str, Any]) -> BertConfig:
        return BertConfig.from_hf(hf)

    @classmethod
    def from_hf_config(cls, hf: dict[str, Any]) -> PoolingModel:
        return cls(cls.config_from_hf(hf))

    def encode(
        self,
        inputs_embeds: torch.Tensor,
        positions: torch.Tensor,
        attn: AttentionMetadata,
        token_type_ids: torch.Tensor,
    ) -> torch.Tensor:
        x = self.embeddings(inputs_embeds, positions, token_type_ids)
        for layer in self.encoder.layer:
            x = layer(x, attn)
        return x


class RobertaModel(BertModel):
    """RoBERTa / XLM-RoBERTa: BERT with positions counted from `pad_token_id + 1`."""

    checkpoint_prefixes = ("roberta.",)

    @classmethod
    def config_from_hf(cls, hf: dict[str, Any]) -> BertConfig:
        return BertConfig.from_hf(hf, position_offset=int(hf.get("pad_token_id", 1)) + 1)


class BertForSequenceClassification(PooledSequenceClassifier, BertModel):
    """The CLS row through BERT's pooler (dense, tanh), then `classifier`."""


class RobertaForSequenceClassification(HeadSequenceClassifier, RobertaModel):
    """The CLS (`<s>`) row through `classifier.dense`, tanh, `classifier.out_proj`
    (cross-encoders such as bge-reranker)."""


class BertForTokenClassification(TokenClassifier, BertModel):
    """`classifier` on every token row (NER style)."""


class RobertaForTokenClassification(BertForTokenClassification, RobertaModel):
    """RoBERTa with `classifier` on every token row."""


class BertPredictionHeadTransform(nn.Module):
    def __init__(self, c: BertConfig):
        super().__init__()
        self.dense = nn.Linear(c.hidden_size, c.hidden_size)
        self.act = activation(c.hidden_act)
        self.LayerNorm = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.act(self.dense(x)))


class BertLMPredictionHead(nn.Module):
    def __init__(self, c: BertConfig):
        super().__init__()
        self.transform = BertPredictionHeadTransform(c)
        self.bias = nn.Parameter(torch.empty(c.vocab_size))
        # Tied (the usual case), `decoder` is the word embeddings and `bias`, as in transformers.
        self.decoder = nn.Linear(c.hidden_size, c.vocab_size)


class BertOnlyMLMHead(nn.Module):
    def __init__(self, c: BertConfig):
        super().__init__()
        self.predictions = BertLMPredictionHead(c)


class BertForMaskedLM(MaskedLM, BertModel):
    """BERT with its masked-LM head: vocabulary logits per token row (SPLADE)."""

    tied_weights: ClassVar[dict[str, str]] = {
        "cls.predictions.decoder.weight": "embeddings.word_embeddings.weight",
        "cls.predictions.decoder.bias": "cls.predictions.bias",
    }

    def __init__(self, c: BertConfig):
        super().__init__(c)
        self.cls = BertOnlyMLMHead(c)

    def compute_logits(
        self, rows: torch.Tensor, vocab_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        head = self.cls.predictions
        return vocab_logits(head.transform(rows), head.decoder, vocab_ids)


class RobertaLMHead(nn.Module):
    """dense, gelu, `layer_norm`, then `decoder` (tied: the word embeddings and `bias`)."""

    def __init__(self, c: BertConfig):
        super().__init__()
        self.dense = nn.Linear(c.hidden_size, c.hidden_size)
        self.layer_norm = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps)
        self.decoder = nn.Linear(c.hidden_size, c.vocab_size)
        self.bias = nn.Parameter(torch.empty(c.vocab_size))

    def transform(self, x: torch.Tensor) -> torch.Tensor:
        # Exact gelu whatever `hidden_act` says, as transformers' RobertaLMHead.
        return self.layer_norm(F.gelu(self.dense(x)))


class RobertaForMaskedLM(MaskedLM, RobertaModel):
    """RoBERTa / XLM-RoBERTa with the masked-LM head `lm_head` (SPLADE)."""

    tied_weights: ClassVar[dict[str, str]] = {
        "lm_head.decoder.weight": "embeddings.word_embeddings.weight",
        "lm_head.decoder.bias": "lm_head.bias",
    }

    def __init__(self, c: BertConfig):
        super().__init__(c)
        self.lm_head = RobertaLMHead(c)

    def compute_logits(
        self, rows: torch.Tensor, vocab_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        return vocab_logits(self.lm_head.transform(rows), self.lm_head.decoder, vocab_ids)


def vocab_logits(
    x: torch.Tensor, decoder: nn.Linear, vocab_ids: torch.Tensor | None
) -> torch.Tensor:
    """`decoder(x)`, or only its `vocab_ids` columns."""
    weight: torch.Tensor = decoder.weight
    bias: torch.Tensor = decoder.bias
    if vocab_ids is not None:
        weight, bias = weight[vocab_ids], bias[vocab_ids]
    return F.linear(x, weight, bias)


class ColBERTModel(BertModel):
    """ColBERT (`HF_ColBERT`): BERT and a bias-free `linear` projection of every token row.

    The projection size comes from the config (`colbert_dim` or `dim`) or, as ColBERT's own
    configs leave it out, from the checkpoint's `linear.weight`.
    """

    shape_keys = ("linear.weight",)
    capabilities = frozenset({Capability.TOKEN_PROJECTION})

    def __init__(self, c: BertConfig, dim: int):
        super().__init__(c)
        self.projection_dim = dim
        self.linear = nn.Linear(c.hidden_size, dim, bias=False)

    @classmethod
    def from_hf_config(cls, hf: dict[str, Any]) -> PoolingModel:
        dim = hf.get("colbert_dim") or hf.get("dim")
        if dim is None:
            shape = (hf.get("checkpoint_shapes") or {}).get("linear.weight")
            if shape is None:
                raise ConfigError(
                    "a ColBERT checkpoint needs linear.weight (its projection), or a "
                    "colbert_dim in config.json"
                )
            dim = shape[0]
        return cls(cls.config_from_hf(hf), int(dim))

    def project_tokens(self, rows: torch.Tensor) -> torch.Tensor:
        return self.linear(rows)
