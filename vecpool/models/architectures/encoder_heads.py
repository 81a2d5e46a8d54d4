"""The task heads that encoder families share, as mixins over a family's base model.

Each builds its modules under the family's checkpoint names (`pooler.dense`, `classifier`), so
checkpoints load as they are. A family's head class lists the mixin before its base model:
`class BertForTokenClassification(TokenClassifier, BertModel)`; the mixin's `__init__` builds
the base model from the same arguments, then adds its head. A head whose layout is a family's
own stays in that family's file.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, cast

import torch
import torch.nn.functional as F
from torch import nn

from vecpool.models.architectures.encoder import register_at
from vecpool.models.base import Capability, PoolingModel
from vecpool.models.layers.basic import activation


class PooledSequenceClassifier(PoolingModel):
    """The pooled row through a dense layer and an activation, then the output layer:
    `out(act(dense(row)))`, `classifier_names` being the paths of `dense` and `out` in the
    checkpoint and `classifier_act` the activation. By default BERT's pooler (`pooler.dense`,
    tanh), then `classifier`; ALBERT's pooler is `pooler` itself, DistilBERT's
    `pre_classifier` (relu). The first constructor argument is the family's config, which
    holds `num_labels`."""

    capabilities = frozenset({Capability.SEQUENCE_CLASSIFIER})
    classifier_names: ClassVar[tuple[str, str]] = ("pooler.dense", "classifier")
    classifier_act: ClassVar[str] = "tanh"

    def __init__(self, c: Any, *args: Any, **kwargs: Any):
        super().__init__(c, *args, **kwargs)
        self.num_labels = c.num_labels
        dense, out = self.classifier_names
        register_at(self, dense, nn.Linear(self.hidden_size, self.hidden_size))
        register_at(self, out, nn.Linear(self.hidden_size, c.num_labels))
        self.classifier_activation = activation(self.classifier_act)

    def classify(self, pooled: torch.Tensor) -> torch.Tensor:
        dense, out = (self.get_submodule(name) for name in self.classifier_names)
        logits: torch.Tensor = out(self.classifier_activation(dense(pooled)))
        return logits


class HeadSequenceClassifier(PooledSequenceClassifier):
    """RoBERTa's layout: the pooled row through `classifier.dense`, the activation
    `classifier_act` (ELECTRA's is gelu), `classifier.out_proj`."""

    classifier_names = ("classifier.dense", "classifier.out_proj")


class TokenClassifier(PoolingModel):
    """`classifier` on every token row (NER style). The first constructor argument is the
    family's config, which holds `num_labels`."""

    capabilities = frozenset({Capability.TOKEN_CLASSIFIER})

    def __init__(self, c: Any, *args: Any, **kwargs: Any):
        super().__init__(c, *args, **kwargs)
        self.num_labels = c.num_labels
        self.classifier = nn.Linear(self.hidden_size, c.num_labels)

    def classify_tokens(self, rows: torch.Tensor) -> torch.Tensor:
        return self.classifier(rows)


@dataclass(frozen=True)
class LMHeadNames:
    """Where a family's checkpoint keeps the parts of its masked-LM head."""

    dense: str
    norm: str
    decoder: str | None  # None: the word embeddings themselves, with `bias` (DeBERTa-v2's)
    bias: str | None = None  # the vocabulary bias kept beside the decoder (tied to the decoder's)

    @classmethod
    def bert_layout(cls, prefix: str, transform: str = "") -> LMHeadNames:
        """BERT's names under `prefix`: `dense` and `LayerNorm` (after `transform`, BERT's
        "transform."), `decoder`, `bias`."""
        return cls(
            dense=f"{prefix}.{transform}dense",
            norm=f"{prefix}.{transform}LayerNorm",
            decoder=f"{prefix}.decoder",
            bias=f"{prefix}.bias",
        )

    def ties(self) -> dict[str, str]:
        """The head's `tied_weights`: the decoder is the word embeddings (and `bias`)."""
        if self.decoder is None:
            return {}
        ties = {f"{self.decoder}.weight": "embeddings.word_embeddings.weight"}
        if self.bias is not None:
            ties[f"{self.decoder}.bias"] = self.bias
        return ties


class MaskedLM(PoolingModel):
    """The masked-LM head: `decoder(norm(act(dense(row))))` on token rows, `dense` to the width
    of the word embeddings, at the family's names (`lm_names`); `lm_act` is the activation
    (None: the config's `hidden_act`). The decoder is tied to the word embeddings unless the
    config sets `tie_word_embeddings: false` (the family declares the pairs in `tied_weights`:
    `lm_names.ties()`). The first constructor argument is the family's config, which holds
    `layer_norm_eps` (and `hidden_act`)."""

    capabilities = frozenset({Capability.MASKED_LM})
    lm_names: LMHeadNames
    lm_act: ClassVar[str | None] = None

    def __init__(self, c: Any, *args: Any, **kwargs: Any):
        super().__init__(c, *args, **kwargs)
        names = self.lm_names
        width = cast(nn.Embedding, self.get_submodule("embeddings.word_embeddings")).embedding_dim
        register_at(self, names.dense, nn.Linear(self.hidden_size, width))
        register_at(self, names.norm, nn.LayerNorm(width, eps=c.layer_norm_eps))
        if names.decoder is not None:
            register_at(self, names.decoder, nn.Linear(width, self.vocab_size))
        if names.bias is not None:
            register_at(self, names.bias, nn.Parameter(torch.empty(self.vocab_size)))
        self.lm_activation = activation(self.lm_act or c.hidden_act)

    @classmethod
    def from_hf_config(cls, hf: dict[str, Any]) -> PoolingModel:
        model = super().from_hf_config(hf)
        model.tie_word_embeddings = bool(hf.get("tie_word_embeddings", True))
        return model

    def compute_logits(
        self, rows: torch.Tensor, vocab_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        names = self.lm_names
        dense, norm = self.get_submodule(names.dense), self.get_submodule(names.norm)
        x = norm(self.lm_activation(dense(rows)))
        if names.decoder is not None:
            decoder = cast(nn.Linear, self.get_submodule(names.decoder))
            return vocab_logits(x, decoder.weight, decoder.bias, vocab_ids)
        assert names.bias is not None, "a head without a decoder has a bias of its own"
        weight = self.get_parameter("embeddings.word_embeddings.weight")
        return vocab_logits(x, weight, self.get_parameter(names.bias), vocab_ids)


def vocab_logits(
    x: torch.Tensor,  # [n, width]
    weight: torch.Tensor,  # [vocab, width]
    bias: torch.Tensor | None,  # [vocab]
    vocab_ids: torch.Tensor | None,
) -> torch.Tensor:  # [n, vocab], or [n, len(vocab_ids)]
    """`x` times the decoder (plus its bias), or only its `vocab_ids` columns."""
    if vocab_ids is not None:
        weight = weight[vocab_ids]
        bias = None if bias is None else bias[vocab_ids]
    return F.linear(x, weight, bias)
