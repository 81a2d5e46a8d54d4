"""jina-reranker-v3 (`JinaForRanking`): a Qwen3 decoder and a projector MLP, a listwise reranker.

One prompt holds a query and several documents, each document followed by `<|embed_token|>` and
the query by `<|rerank_token|>` (`ListwiseRerankerConfig.jina_v3`). The final hidden states at
those tokens go through `projector` (Linear, ReLU, Linear, no biases: hidden -> hidden / 2 ->
512), and a document's score is the cosine of its vector with the query's. The checkpoint holds
the decoder under `model.` and the MLP as `projector.0` / `projector.2`; its remote code replaces
the language-model head by an identity, so there is none.
"""

from __future__ import annotations

import torch
from torch import nn

from vecpool.config import ListwiseRerankerConfig
from vecpool.models.architectures.decoder import DecoderConfig, LayerRotary
from vecpool.models.architectures.qwen3 import Qwen3Model
from vecpool.models.base import Capability

PROJECTOR_DIM = 512  # fixed by the model's code, not read from config.json


class JinaForRanking(Qwen3Model):
    """Qwen3 plus jina-reranker-v3's projector, applied to the rows at the marker tokens."""

    capabilities = frozenset({Capability.LISTWISE_RANKER})
    listwise_reranker = ListwiseRerankerConfig.jina_v3()

    def __init__(self, c: DecoderConfig, rotary: LayerRotary):
        super().__init__(c, rotary)
        self.projector = nn.Sequential(
            nn.Linear(c.hidden_size, c.hidden_size // 2, bias=False),
            nn.ReLU(),
            nn.Linear(c.hidden_size // 2, PROJECTOR_DIM, bias=False),
        )

    def project_listwise(self, rows: torch.Tensor) -> torch.Tensor:
        """`[n, hidden]` rows at the marker tokens -> `[n, 512]` vectors."""
        return self.projector(rows)
