"""BERT-family encoders (BERT, RoBERTa, XLM-RoBERTa): bidirectional, post-norm, absolute positions.

Besides the base models: their sequence- and token-classification heads, their masked-LM heads
(SPLADE) and ColBERT's projection (`HF_ColBERT`), each a method the pooling runner applies to
the rows it selected.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Self

import torch
from torch import nn

from vecpool.errors import ConfigError
from vecpool.models.architectures.encoder import EncoderModel
from vecpool.models.architectures.encoder_heads import (
    HeadSequenceClassifier,
    LMHeadNames,
    MaskedLM,
    PooledSequenceClassifier,
    TokenClassifier,
)
from vecpool.models.base import Capability, PoolingModel, hf_num_labels
from vecpool.models.hf import hf_get
from vecpool.models.layers.attention import AttentionMetadata
from vecpool.models.layers.basic import (
    activation_name,
    linear_activation,
)
from vecpool.models.layers.encoder_blocks import DenseNorm, FusedSelfAttention, LayerSizes

# transformers' BertConfig defaults, for the keys a config.json may leave out.
_BERT_DEFAULTS: dict[str, Any] = {
    "hidden_act": "gelu",
    "type_vocab_size": 2,
    "layer_norm_eps": 1e-12,
}


@dataclass(frozen=True)
class BertConfig:
    """The sizes of BERT's layers, which the families built of them read too."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int
    hidden_act: str
    max_position_embeddings: int
    type_vocab_size: int  # 0: no token types (MPNet, DistilBERT)
    layer_norm_eps: float
    position_offset: int  # RoBERTa numbers positions from padding_idx + 1
    num_labels: int  # outputs of a classification head
    absolute_positions: bool = True  # position embeddings added to the rows (not Jina BERT's)

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
        return cls.read(hf, position_offset=position_offset)

    @classmethod
    def read(
        cls, hf: dict[str, Any], defaults: dict[str, Any] | None = None, **fields: Any
    ) -> Self:
        """The fields from `hf`'s BERT keys, where `defaults` gives what a key left out means
        (BERT's own defaults otherwise; a key without one is required), `fields` the rest (a
        subclass's among them)."""
        defaults = {**_BERT_DEFAULTS, **(defaults or {})}

        def get(key: str) -> Any:
            value = hf_get(hf, key, default=defaults.get(key))
            if value is None:
                raise ConfigError(f"config.json has no {key!r}")
            return value

        read = {
            "vocab_size": get("vocab_size"),
            "hidden_size": get("hidden_size"),
            "num_layers": get("num_hidden_layers"),
            "num_heads": get("num_attention_heads"),
            "intermediate_size": get("intermediate_size"),
            "hidden_act": get("hidden_act"),
            "max_position_embeddings": get("max_position_embeddings"),
            "type_vocab_size": get("type_vocab_size"),
            "layer_norm_eps": get("layer_norm_eps"),
            "position_offset": 0,
            "num_labels": hf_num_labels(hf),
        }
        return cls(**{**read, **fields})


class BertEmbeddings(nn.Module):
    """The rows, plus their token types' embeddings (where `type_vocab_size` is positive: not
    MPNet's, DistilBERT's) and their positions' (counted from `position_offset`; not Jina
    BERT's), normed."""

    def __init__(self, c: BertConfig):
        super().__init__()
        self.word_embeddings = nn.Embedding(c.vocab_size, c.hidden_size)
        self.position_embeddings: nn.Embedding | None = None
        if c.absolute_positions:
            self.position_embeddings = nn.Embedding(c.max_position_embeddings, c.hidden_size)
        self.token_type_embeddings: nn.Embedding | None = None
        if c.type_vocab_size > 0:
            self.token_type_embeddings = nn.Embedding(c.type_vocab_size, c.hidden_size)
        self.LayerNorm = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps)
        self.position_offset = c.position_offset

    def forward(
        self, inputs_embeds: torch.Tensor, positions: torch.Tensor, types: torch.Tensor | None
    ) -> torch.Tensor:
        # Same order of additions as the reference, so that results match to the last bit.
        x = inputs_embeds
        if self.token_type_embeddings is not None:
            x = x + self.token_type_embeddings(types)
        if self.position_embeddings is not None:
            x = x + self.position_embeddings(positions + self.position_offset)
        return self.LayerNorm(x)


class BertSelfAttention(FusedSelfAttention):
    """`query`, `key`, `value`; the output projection is `BertAttention.output`'s."""


class BertAttention(nn.Module):
    """`self`, the self-attention (BERT's, or a family's own: DeBERTa-v2's), then `output`,
    `LayerNorm(dense(x) + x)` from the attention's `width` outputs."""

    def __init__(self, c: LayerSizes, self_attention: nn.Module | None = None, width: int = 0):
        super().__init__()
        self.self = BertSelfAttention(c) if self_attention is None else self_attention
        self.output = DenseNorm(width or c.hidden_size, c)

    def forward(
        self, x: torch.Tensor, attn: AttentionMetadata, *extra: torch.Tensor
    ) -> torch.Tensor:
        return self.output(self.self(x, attn, *extra), x)


class BertIntermediate(nn.Module):
    def __init__(self, c: LayerSizes):
        super().__init__()
        self.dense = nn.Linear(c.hidden_size, c.intermediate_size)
        self.act = activation_name(c.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear_activation(self.dense, x, self.act)


class BertLayer(nn.Module):
    """BERT's post-norm layer: `attention` (BERT's, or a family's own: MPNet's, DeBERTa-v2's),
    then `output(intermediate(x), x)`. `extra` are what the family's attention reads besides
    `attn` (a position bias)."""

    def __init__(self, c: LayerSizes, attention: nn.Module | None = None):
        super().__init__()
        self.attention = BertAttention(c) if attention is None else attention
        self.intermediate = BertIntermediate(c)
        self.output = DenseNorm(c.intermediate_size, c)

    def forward(
        self, x: torch.Tensor, attn: AttentionMetadata, *extra: torch.Tensor
    ) -> torch.Tensor:
        x = self.attention(x, attn, *extra)
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


class BertForMaskedLM(MaskedLM, BertModel):
    """BERT with its masked-LM head `cls.predictions`: vocabulary logits per token row (SPLADE)."""

    lm_names = LMHeadNames.bert_layout("cls.predictions", "transform.")
    tied_weights = lm_names.ties()


class RobertaForMaskedLM(MaskedLM, RobertaModel):
    """RoBERTa / XLM-RoBERTa with the masked-LM head `lm_head` (SPLADE): exact gelu whatever
    `hidden_act` says, as transformers' RobertaLMHead."""

    lm_names = LMHeadNames(
        dense="lm_head.dense",
        norm="lm_head.layer_norm",
        decoder="lm_head.decoder",
        bias="lm_head.bias",
    )
    lm_act = "gelu"
    tied_weights = lm_names.ties()


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
