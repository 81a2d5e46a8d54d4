"""ColQwen2 (`ColQwen2ForRetrieval`): Qwen2-VL's vision tower and language model, and a linear
projection (`embedding_proj_layer`) of every token's last hidden state to `embedding_dim`:
one L2-normalised vector per token of a page image's prompt or a text query, scored by MaxSim.

As transformers' class runs it, the language model gets the input embeddings alone (the
images' rows spliced in at their placeholders), so it never sees the multimodal rotary
positions: every token sits at its plain position 0, 1, 2, ... (the input stage leaves M-RoPE
out for this model type, `vecpool.inputs.vision_prompts.VisionFormat.mrope`). How pages and
queries are written (the processor's image prompt, query prefix and augmentation tokens) is
the input stage's: `vecpool.inputs.vision_prompts.read_retrieval_layout`.

Checkpoints load in transformers 5's layout (`vlm.visual.`, `vlm.language_model.`,
`embedding_proj_layer.`) and the earlier one (`vlm.model.visual.`, `vlm.model.language_model.`).
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import nn

from vecpool.errors import ConfigError
from vecpool.models.architectures.decoder import DecoderConfig
from vecpool.models.architectures.qwen2_vl import MRopeRotary, Qwen2VLModel, VisionConfig
from vecpool.models.base import Capability, PoolingModel

_DEFAULT_EMBEDDING_DIM = 128  # transformers' ColQwen2Config


def retrieval_parts(hf: dict[str, Any], vlm_type: str) -> tuple[dict[str, Any], int]:
    """(`vlm_config`, `embedding_dim`) of a retrieval model's config.json (ColQwen2, ColPali);
    `ConfigError` naming the field that is missing or wrong."""
    vlm = hf.get("vlm_config")
    if not isinstance(vlm, dict):
        raise ConfigError("config.json: a retrieval model needs a vlm_config object")
    found = vlm.get("model_type", vlm_type)
    if found != vlm_type:
        raise ConfigError(f"config.json: vlm_config.model_type is {found!r}, expected {vlm_type!r}")
    dim = hf.get("embedding_dim", _DEFAULT_EMBEDDING_DIM)
    if isinstance(dim, bool) or not isinstance(dim, int) or dim < 1:
        raise ConfigError(f"config.json: embedding_dim must be a positive integer, got {dim!r}")
    return vlm, dim


class ColQwen2ForRetrieval(Qwen2VLModel):
    """Qwen2-VL's base model and `embedding_proj_layer` (see the module docstring)."""

    checkpoint_prefixes = (  # type: ignore[assignment]
        "vlm.model.language_model.",
        "vlm.language_model.",
        "vlm.model.",
        "vlm.",
    )
    capabilities = frozenset({Capability.IMAGE_TOWER, Capability.TOKEN_PROJECTION})
    unused_checkpoint_keys: ClassVar[tuple[str, ...]] = ("*.rotary_emb.inv_freq", "lm_head.*")

    def __init__(self, c: DecoderConfig, rotary: MRopeRotary, vision: VisionConfig, dim: int):
        super().__init__(c, rotary, vision)
        self.projection_dim = dim
        self.embedding_proj_layer = nn.Linear(c.hidden_size, dim)

    @classmethod
    def from_hf_config(cls, hf: dict[str, Any]) -> PoolingModel:
        vlm, dim = retrieval_parts(hf, "qwen2_vl")
        return cls(*cls.read_parts(vlm), dim)

    def project_tokens(self, rows: torch.Tensor) -> torch.Tensor:
        """`[n, hidden]` -> `[n, embedding_dim]`, before the normalization the head applies."""
        return self.embedding_proj_layer(rows)
