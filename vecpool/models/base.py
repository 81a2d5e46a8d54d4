"""The interface every architecture implements. Models know nothing of requests."""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import nn

from vecpool.models.attention import AttentionMetadata


class PoolingModel(nn.Module):
    """A transformer that maps a flat batch of input embeddings to hidden states.

    Subclasses keep Hugging Face's submodule names so that checkpoint names map directly, and
    set the class attributes below that describe how their checkpoints are laid out.
    """

    # Prefixes a checkpoint may carry before our parameter names ("bert." from a *For* class).
    checkpoint_prefixes: ClassVar[tuple[str, ...]] = ()
    # Checkpoint entries we knowingly leave unused: glob patterns (after prefix removal).
    unused_checkpoint_keys: ClassVar[tuple[str, ...]] = ()
    # Parameters that share storage with another when the checkpoint omits them (tied heads).
    tied_weights: ClassVar[dict[str, str]] = {}
    # Parameters a checkpoint may lack; the loader calls `drop_parameter` for each one missing.
    optional_parameters: ClassVar[tuple[str, ...]] = ()

    hidden_size: int
    vocab_size: int
    max_positions: int  # the longest sequence the position scheme supports
    is_causal: bool
    uses_token_type_ids: bool = False

    @classmethod
    def from_hf_config(cls, hf: dict[str, Any]) -> PoolingModel:
        """Build the (empty) module from a Hugging Face `config.json` dict."""
        raise NotImplementedError

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """`[num_tokens]` ids -> `[num_tokens, hidden]`: the lookup that prompt embeds replace."""
        raise NotImplementedError

    def forward(
        self,
        inputs_embeds: torch.Tensor,  # [num_tokens, hidden]
        positions: torch.Tensor,  # [num_tokens] int64
        attn: AttentionMetadata,
        token_type_ids: torch.Tensor | None = None,  # [num_tokens] int64, encoders only
    ) -> torch.Tensor:  # [num_tokens, hidden] final hidden states
        raise NotImplementedError

    @property
    def default_pooler(self) -> str:
        """Sequence pooling when the folder does not say: LAST for causal models, else CLS."""
        return "LAST" if self.is_causal else "CLS"

    def drop_parameter(self, name: str) -> None:
        """Forget optional parameter `name`, which the checkpoint does not have."""
        raise NotImplementedError(name)

    def post_load(self) -> None:
        """Called once the weights are in place (e.g. to tie or derive tensors)."""
