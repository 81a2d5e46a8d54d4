"""The base model every bidirectional encoder family builds on (`EncoderModel`)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import ClassVar, Protocol, cast

import torch
from torch import nn

from vecpool.models.base import PoolingModel
from vecpool.models.layers.attention import AttentionMetadata
from vecpool.models.layers.encoder_blocks import pad_to_hidden


def register_at(parent: nn.Module, path: str, value: nn.Module | nn.Parameter) -> None:
    """Register a module or parameter at the dotted `path` below `parent`, adding plain
    containers on the way: a checkpoint family's name for a part, wherever its layout puts it."""
    *containers, name = path.split(".")
    for part in containers:
        if part not in parent._modules:
            parent.add_module(part, nn.Module())
        parent = parent.get_submodule(part)
    setattr(parent, name, value)


class EncoderSizes(Protocol):
    """What `EncoderModel` reads from a family's config."""

    @property
    def hidden_size(self) -> int: ...

    @property
    def vocab_size(self) -> int: ...


class EncoderModel(PoolingModel):
    """A bidirectional encoder: `embed` turns the input rows into the first layer's input,
    every layer of `layer_stack` runs on `(x, attn, *layer_inputs)`, the inputs computed once
    per step for all layers (a position bias, rotary tables; none for BERT), and `final` turns
    the last layer's output into the hidden states.

    The input rows are the lookup `embeddings.word_embeddings` (zero columns after it where
    the embeddings are narrower than the hidden size). A family with token types reads type 0
    where the batch gives none. `embed` calls the family's `embeddings` module on the rows,
    positions and token types, and `layer_stack` is BERT's `encoder.layer`: families laid out
    otherwise override them.
    """

    is_causal = False
    # The sequence pooling when the folder does not say: how the family's models are trained.
    pooling: ClassVar[str] = "CLS"
    embeddings: nn.Module  # the family's: `word_embeddings`, and what it adds to the rows

    def __init__(self, c: EncoderSizes, max_positions: int, type_vocab_size: int = 0):
        super().__init__()
        self.hidden_size = c.hidden_size
        self.vocab_size = c.vocab_size
        self.max_positions = max_positions
        # With one token type (RoBERTa) every row takes type 0, whatever a tokenizer says.
        self.uses_token_type_ids = type_vocab_size > 1
        self.has_token_types = type_vocab_size > 0

    @property
    def default_pooler(self) -> str:
        return self.pooling

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        # A family's own `embeddings` module, which mypy sees only as `nn.Module.__getattr__`.
        rows = self.embeddings.word_embeddings(input_ids)  # type: ignore[operator]
        return pad_to_hidden(rows, self.hidden_size)

    def forward(
        self,
        inputs_embeds: torch.Tensor,
        positions: torch.Tensor,
        attn: AttentionMetadata,
        token_type_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if token_type_ids is None and self.has_token_types:
            token_type_ids = torch.zeros_like(positions)
        x = self.embed(inputs_embeds, positions, token_type_ids)
        inputs = self.layer_inputs(x, positions, attn)
        for layer in self.layer_stack():
            x = layer(x, attn, *inputs)
        return self.final(x)

    def embed(
        self, inputs_embeds: torch.Tensor, positions: torch.Tensor, types: torch.Tensor | None
    ) -> torch.Tensor:  # [num_tokens, hidden]: the first layer's input
        """The family's `embeddings` of the input rows (`[num_tokens, hidden]`), positions and
        token types (`[num_tokens]` int64; None where the family has none)."""
        x: torch.Tensor = self.embeddings(inputs_embeds, positions, types)
        return x

    def layer_stack(self) -> Iterable[nn.Module]:
        """The layers, in the order they run."""
        return cast(nn.ModuleList, self.get_submodule("encoder.layer"))

    def layer_inputs(
        self, x: torch.Tensor, positions: torch.Tensor, attn: AttentionMetadata
    ) -> tuple[torch.Tensor, ...]:
        """What every layer reads besides its input and `attn`, computed once per step from the
        first layer's input `x` (its dtype and device) and the positions."""
        return ()

    def final(self, x: torch.Tensor) -> torch.Tensor:
        """The hidden states from the last layer's output: as they are (post-norm layers), or
        through the final norm of a pre-norm stack."""
        return x
