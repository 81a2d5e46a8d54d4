"""The task heads that encoder families share, as mixins over a family's base model.

Each keeps transformers' attribute names (`pooler.dense`, `classifier`), so checkpoint names
map unchanged. A family's head class lists the mixin before its base model:
`class BertForTokenClassification(TokenClassifier, BertModel)`; the mixin's `__init__` builds
the base model from the same arguments, then adds its head. A head whose layout is a family's
own stays in that family's file.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import nn

from vecpool.models.base import Capability, PoolingModel
from vecpool.models.layers.basic import activation


class TanhPooler(nn.Module):
    """BERT's pooler: `tanh(dense(x))` on the pooled row."""

    def __init__(self, hidden_size: int):
        super().__init__()
        self.dense = nn.Linear(hidden_size, hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.dense(x))


class PooledSequenceClassifier(PoolingModel):
    """The pooled row through BERT's `pooler` (dense, tanh), then `classifier`. The first
    constructor argument is the family's config, which holds `num_labels`."""

    capabilities = frozenset({Capability.SEQUENCE_CLASSIFIER})

    def __init__(self, c: Any, *args: Any, **kwargs: Any):
        super().__init__(c, *args, **kwargs)
        self.num_labels = c.num_labels
        self.pooler = TanhPooler(self.hidden_size)
        self.classifier = nn.Linear(self.hidden_size, c.num_labels)

    def classify(self, pooled: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.pooler(pooled))


class ClassificationHead(nn.Module):
    """RoBERTa's classification head: `out_proj(act(dense(x)))`."""

    def __init__(self, hidden_size: int, num_labels: int, act: str):
        super().__init__()
        self.dense = nn.Linear(hidden_size, hidden_size)
        self.out_proj = nn.Linear(hidden_size, num_labels)
        self.act = activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out_proj(self.act(self.dense(x)))


class HeadSequenceClassifier(PoolingModel):
    """The pooled row through `classifier`, a `ClassificationHead` (`classifier.dense`, the
    activation `classifier_act`, `classifier.out_proj`): RoBERTa's layout."""

    capabilities = frozenset({Capability.SEQUENCE_CLASSIFIER})
    classifier_act: ClassVar[str] = "tanh"  # ELECTRA's head has gelu

    def __init__(self, c: Any, *args: Any, **kwargs: Any):
        super().__init__(c, *args, **kwargs)
        self.num_labels = c.num_labels
        self.classifier = ClassificationHead(self.hidden_size, c.num_labels, self.classifier_act)

    def classify(self, pooled: torch.Tensor) -> torch.Tensor:
        return self.classifier(pooled)


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


class MaskedLM(PoolingModel):
    """A masked-LM head model whose decoder is tied to the word embeddings unless the config
    sets `tie_word_embeddings: false` (the family declares the pairs in `tied_weights`)."""

    capabilities = frozenset({Capability.MASKED_LM})

    @classmethod
    def from_hf_config(cls, hf: dict[str, Any]) -> PoolingModel:
        model = super().from_hf_config(hf)
        model.tie_word_embeddings = bool(hf.get("tie_word_embeddings", True))
        return model
