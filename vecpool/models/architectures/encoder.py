"""The base model every bidirectional encoder family builds on (`EncoderModel`)."""

from __future__ import annotations

from typing import Protocol

import torch

from vecpool.models.base import PoolingModel
from vecpool.models.layers.attention import AttentionMetadata
from vecpool.models.layers.encoder_blocks import pad_to_hidden


class EncoderSizes(Protocol):
    """What `EncoderModel` reads from a family's config."""

    @property
    def hidden_size(self) -> int: ...

    @property
    def vocab_size(self) -> int: ...


class EncoderModel(PoolingModel):
    """A bidirectional encoder whose input rows are the lookup `embeddings.word_embeddings`
    (zero columns after it where the embeddings are narrower than the hidden size), and whose
    token types are all 0 where the batch gives none. Families implement `encode`, or, reading
    no token types, `forward` itself."""

    is_causal = False

    def __init__(self, c: EncoderSizes, max_positions: int, type_vocab_size: int = 0):
        super().__init__()
        self.hidden_size = c.hidden_size
        self.vocab_size = c.vocab_size
        self.max_positions = max_positions
        # With one token type (RoBERTa) every row takes type 0, whatever a tokenizer says.
        self.uses_token_type_ids = type_vocab_size > 1

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        # A family's own `embeddings` module, which mypy sees only as `nn.Module.__getattr__`.
        rows = self.embeddings.word_embeddings(input_ids)  # type: ignore[union-attr,operator]
        return pad_to_hidden(rows, self.hidden_size)

    def forward(
        self,
        inputs_embeds: torch.Tensor,
        positions: torch.Tensor,
        attn: AttentionMetadata,
        token_type_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if token_type_ids is None:
            token_type_ids = torch.zeros_like(positions)
        return self.encode(inputs_embeds, positions, attn, token_type_ids)

    def encode(
        self,
        inputs_embeds: torch.Tensor,  # [num_tokens, hidden]
        positions: torch.Tensor,  # [num_tokens] int64
        attn: AttentionMetadata,
        token_type_ids: torch.Tensor,  # [num_tokens] int64
    ) -> torch.Tensor:  # [num_tokens, hidden] final hidden states
        raise NotImplementedError
