"""ColPali (`ColPaliForRetrieval`): PaliGemma (a SigLIP vision tower, its multi-modal
projector, a Gemma language model) and a linear projection (`embedding_proj_layer`) of every
token's last hidden state to `embedding_dim`: one L2-normalised vector per token of a page
image's prompt or a text query, scored by MaxSim.

As transformers runs it on its processor's output (`model(**processor.process_images(...))`):

- an image's patches run through SigLIP's encoder and `post_layernorm` (no pooling head), each
  patch row through `multi_modal_projector` into the language model's width, and these rows
  take the places of the image's `image_seq_length` placeholder tokens (the prompt's prefix);
- the language model attends bidirectionally over the whole prompt: the processor's
  `token_type_ids` are all 0 (no suffix), and PaliGemma lets a prefix of type 0 attend both
  ways; queries too;
- positions count from 1 (PaliGemma's `position_ids = arange + 1`; rotary angles are
  relative, so the shift changes only their rounding);
- the Gemma lookup is scaled by sqrt(hidden_size), the image rows are not (they enter as
  input embeddings).

How pages and queries are written (the image prompt, BOS, query prefix and augmentation
tokens) is the input stage's: `vecpool.inputs.vision_prompts.read_retrieval_layout`.

Checkpoint names: the language model under `vlm.language_model.model.` (as transformers saves
it), `vlm.model.language_model.` or `vlm.language_model.`; the SigLIP tower under
`vlm.vision_tower.vision_model.` or `vlm.vision_tower.`, which is why its modules
(`embeddings`, `encoder`, `post_layernorm`) sit at the top level here, beside Gemma's
(`embed_tokens`, `layers`, `norm`): either checkpoint layout maps onto them by a prefix.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, ClassVar

import torch
from torch import nn

from vecpool.errors import ConfigError, EngineError
from vecpool.models.architectures.clip import (
    Encoder,
    ImageLayout,
    VisionTowerConfig,
    check_grids,
    sub_config,
    vision_tower_config,
)
from vecpool.models.architectures.colqwen2 import retrieval_parts
from vecpool.models.architectures.decoder import DecoderConfig
from vecpool.models.architectures.gemma import GemmaModel
from vecpool.models.architectures.siglip import SIGLIP_VISION_DEFAULTS, SiglipVisionEmbeddings
from vecpool.models.base import Capability, ImageBatch, PoolingModel
from vecpool.models.layers.attention import AttentionMetadata
from vecpool.models.layers.basic import Rotary

# transformers' PaliGemmaConfig defaults for its sub-configs (paligemma-3b).
_TEXT_DEFAULTS: dict[str, Any] = {
    "hidden_size": 2048,
    "num_hidden_layers": 18,
    "intermediate_size": 16384,
    "num_attention_heads": 8,
    "num_key_value_heads": 1,
    "vocab_size": 257152,
    "max_position_embeddings": 8192,
}
_VISION_DEFAULTS: dict[str, Any] = {
    **SIGLIP_VISION_DEFAULTS,
    "intermediate_size": 4096,
    "hidden_size": 1152,
    "patch_size": 14,
    "image_size": 224,
    "num_hidden_layers": 27,
    "num_attention_heads": 16,
}
_PROJECTION_DIM = 2048  # PaliGemmaConfig.projection_dim


class MultiModalProjector(nn.Module):
    """PaliGemma's `multi_modal_projector`: one linear map of each patch row."""

    def __init__(self, vision_width: int, text_width: int):
        super().__init__()
        self.linear = nn.Linear(vision_width, text_width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)


class ColPaliForRetrieval(GemmaModel):
    """PaliGemma and `embedding_proj_layer` (see the module docstring)."""

    checkpoint_prefixes = (  # type: ignore[assignment]
        "vlm.language_model.model.",
        "vlm.model.language_model.",
        "vlm.language_model.",
        "vlm.vision_tower.vision_model.",
        "vlm.model.vision_tower.vision_model.",
        "vlm.model.vision_tower.",
        "vlm.vision_tower.",
        "vlm.model.",
        "vlm.",
    )
    capabilities = frozenset({Capability.IMAGE_TOWER, Capability.TOKEN_PROJECTION})
    # The tower's attention-pooling head (PaliGemma reads the patch rows), a language-model head.
    unused_checkpoint_keys: ClassVar[tuple[str, ...]] = (
        "*.rotary_emb.inv_freq",
        "head.*",
        "lm_head.*",
    )

    def __init__(self, c: DecoderConfig, rotary: Rotary, vision: VisionTowerConfig, dim: int):
        super().__init__(c, rotary)
        self.vision = vision
        self.projection_dim = dim
        self.image_patch_dim = vision.patch_dim
        self.image_grid = vision.grid
        self.embeddings = SiglipVisionEmbeddings(vision)
        self.encoder = Encoder(vision)
        self.post_layernorm = nn.LayerNorm(vision.hidden_size, eps=vision.layer_norm_eps)
        self.multi_modal_projector = MultiModalProjector(vision.hidden_size, c.hidden_size)
        self.embedding_proj_layer = nn.Linear(c.hidden_size, dim)

    @classmethod
    def from_hf_config(cls, hf: dict[str, Any]) -> PoolingModel:
        vlm, dim = retrieval_parts(hf, "paligemma")
        text = sub_config(vlm, "text_config", _TEXT_DEFAULTS)
        if text.get("model_type", "gemma") != "gemma":
            raise ConfigError(
                f"config.json: vlm_config.text_config.model_type {text['model_type']!r} is not "
                "supported (ColPali on PaliGemma's Gemma)"
            )
        vision = vision_tower_config(
            sub_config(vlm, "vision_config", _VISION_DEFAULTS), resized_positions=False
        )
        projection = vlm.get("projection_dim", _PROJECTION_DIM)
        c = cls.config_from_hf(text)
        if projection != c.hidden_size:
            raise ConfigError(
                f"config.json: vlm_config.projection_dim {projection} is not the language "
                f"model's hidden_size {c.hidden_size}"
            )
        # Bidirectional over the whole prompt, as PaliGemma attends over a prefix of type 0.
        c = replace(c, is_causal=False)
        return cls(c, Rotary(c.head_dim, text), vision, dim)

    def forward(
        self,
        inputs_embeds: torch.Tensor,  # [num_tokens, hidden], image rows in place (the runner's)
        positions: torch.Tensor,  # [num_tokens] int64, from 0
        attn: AttentionMetadata,
        token_type_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:  # [num_tokens, hidden]
        return super().forward(inputs_embeds, positions + 1, attn)  # PaliGemma counts from 1

    def vision_rows(
        self, images: ImageBatch, use_varlen: bool, batch_invariant: bool = False
    ) -> torch.Tensor:  # [num_image_tokens, hidden]
        """The rows of the images' placeholder tokens, image after image: every patch's row
        of the tower, projected."""
        check_grids(images, self.vision.grid, type(self).__name__)
        layout = _fixed_layout(images, use_varlen, batch_invariant)
        x = self.encoder(self.embeddings(images, layout), layout.attn)
        rows = self.multi_modal_projector(self.post_layernorm(x))
        if images.rows.shape[0] not in (0, rows.shape[0]):
            raise EngineError(
                f"the step's images give {rows.shape[0]} rows for {images.rows.shape[0]} "
                "placeholder tokens"
            )
        return rows

    def project_tokens(self, rows: torch.Tensor) -> torch.Tensor:
        """`[n, hidden]` -> `[n, embedding_dim]`, before the normalization the head applies."""
        return self.embedding_proj_layer(rows)


def _fixed_layout(images: ImageBatch, use_varlen: bool, batch_invariant: bool) -> ImageLayout:
    """The tower's flat layout of images of one grid: one sequence per image, its patches."""
    device = images.pixel_values.device
    n, per = images.num_images, images.max_patches
    cu = images.cu_patches.long()
    attn = AttentionMetadata(
        cu_seqlens=cu.to(torch.int32),
        max_seqlen=per,
        seq_ids=torch.arange(n, device=device).repeat_interleave(per),
        pos_in_seq=torch.arange(per, device=device).repeat(n),
        use_varlen=use_varlen,
        batch_invariant=batch_invariant,
    )
    rows = torch.arange(n * per, device=device)
    return ImageLayout(attn=attn, patch_rows=rows, first_rows=cu[:-1])
