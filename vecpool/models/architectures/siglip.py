"""SigLIP and SigLIP2: dual encoders on CLIP's pre-norm encoder, bidirectional text attention,
and an attention-pooling (MAP) head on the image tower.

A text row's output is its final hidden state after `final_layer_norm` through the text
`head` (linear: per row it gives at the last row what transformers gives for the pooled one;
SigLIP pools the last token). An image's patch rows run as one flat sequence per image, through
`post_layernorm`; the head's learned probe then attends over each image's rows alone, and its
output (the vision tower's width, which is the shared space's) fills the image's row.

SigLIP reads fixed-size images: patch rows laid out (channel, y, x) for its Conv2d patch
embedding, a fixed position table. SigLIP2 reads images of any grid of patches (its processor's
own rows, channels last, for a Linear patch embedding); its position table is resized to each
grid as transformers resizes it, once per grid of the step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from vecpool.errors import ConfigError
from vecpool.models.architectures.clip import (
    VIT_B_DEFAULTS,
    DualEncoder,
    Encoder,
    EncoderMLP,
    ImageLayout,
    TextTowerConfig,
    TextTransformer,
    VisionTowerConfig,
    check_grids,
    conv_patch_rows,
    image_layout,
    sub_config,
    text_tower_config,
    vision_tower_config,
)
from vecpool.models.base import ImageBatch, PoolingModel
from vecpool.models.layers.attention import AttentionMetadata

# transformers' SiglipTextConfig / SiglipVisionConfig defaults (google/siglip-base-patch16-224);
# Siglip2's are the same, with `num_patches` for `image_size`.
SIGLIP_TEXT_DEFAULTS: dict[str, Any] = {
    "vocab_size": 32000,
    "hidden_size": 768,
    "intermediate_size": 3072,
    "num_hidden_layers": 12,
    "num_attention_heads": 12,
    "max_position_embeddings": 64,
    "hidden_act": "gelu_pytorch_tanh",
    "layer_norm_eps": 1e-6,
    "projection_size": None,  # the hidden size
    "pad_token_id": 1,
}
SIGLIP_VISION_DEFAULTS: dict[str, Any] = {
    **VIT_B_DEFAULTS,
    "patch_size": 16,
    "num_patches": 256,
    "hidden_act": "gelu_pytorch_tanh",
    "layer_norm_eps": 1e-6,
    "vision_use_head": True,
}


@dataclass(frozen=True)
class SiglipConfig:
    text: TextTowerConfig
    vision: VisionTowerConfig
    projection_size: int  # the text head's output: the shared space's width
    pad_token_id: int  # texts are padded with it to the text tower's length, as trained

    @classmethod
    def from_hf(cls, hf: dict[str, Any], *, resized_positions: bool) -> SiglipConfig:
        text_values = sub_config(hf, "text_config", SIGLIP_TEXT_DEFAULTS)
        vision_values = sub_config(hf, "vision_config", SIGLIP_VISION_DEFAULTS)
        text = text_tower_config(text_values)
        vision = vision_tower_config(vision_values, resized_positions=resized_positions)
        if vision_values.get("vision_use_head") is False:
            raise ConfigError(
                "config.json: vision_config.vision_use_head is false: the image tower has no "
                "attention-pooling head, so images have no embedding"
            )
        projection = int(text_values.get("projection_size") or text.hidden_size)
        if projection != vision.hidden_size:
            raise ConfigError(
                f"config.json: text_config.projection_size {projection} differs from "
                f"vision_config.hidden_size {vision.hidden_size}: texts and images would not "
                "share one space"
            )
        pad = int(text_values["pad_token_id"])
        return cls(text=text, vision=vision, projection_size=projection, pad_token_id=pad)


class SiglipTextTransformer(TextTransformer):
    def __init__(self, c: TextTowerConfig, projection_size: int):
        super().__init__(c, causal=False)
        self.head = nn.Linear(c.hidden_size, projection_size)


class PoolingAttention(nn.Module):
    """`torch.nn.MultiheadAttention`'s parameters, under its names (`in_proj_weight` holds the
    query, key and value projections stacked)."""

    def __init__(self, c: VisionTowerConfig):
        super().__init__()
        hidden = c.hidden_size
        self.num_heads = c.num_heads
        self.in_proj_weight = nn.Parameter(torch.empty(3 * hidden, hidden))
        self.in_proj_bias = nn.Parameter(torch.empty(3 * hidden))
        self.out_proj = nn.Linear(hidden, hidden)

    def forward(
        self,
        probe: torch.Tensor,  # [hidden]: the one query, the same for every image
        x: torch.Tensor,  # [num_rows, hidden]: every image's rows
        layout: ImageLayout,
        num_images: int,
    ) -> torch.Tensor:  # [num_images, hidden]
        """The probe's attention over each image's rows alone."""
        hidden = x.shape[1]
        head_dim = hidden // self.num_heads
        weight, bias = self.in_proj_weight, self.in_proj_bias
        q = F.linear(probe, weight[:hidden], bias[:hidden])  # [hidden]
        kv = F.linear(x, weight[hidden:], bias[hidden:])  # [num_rows, 2 * hidden]
        longest = layout.attn.max_seqlen
        mask: torch.Tensor | None = None
        if x.shape[0] != num_images * longest:  # images of several sizes: padded, masked
            padded = kv.new_zeros(num_images * longest, 2 * hidden)
            kv = padded.index_copy_(0, layout.attn.seq_ids * longest + layout.attn.pos_in_seq, kv)
            cu = layout.attn.cu_seqlens.long()
            lengths = cu[1:] - cu[:-1]  # [num_images]
            columns = torch.arange(longest, device=x.device)
            mask = (columns[None, :] < lengths[:, None])[:, None, None, :]  # [n, 1, 1, longest]
        # [num_images, heads, longest, head_dim] each
        k, v = kv.view(num_images, longest, 2, self.num_heads, head_dim).permute(2, 0, 3, 1, 4)
        q = q.view(1, self.num_heads, 1, head_dim).expand(num_images, -1, -1, -1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # [n, heads, 1, head_dim]
        return self.out_proj(out.reshape(num_images, hidden))


class MultiheadAttentionPoolingHead(nn.Module):
    """SigLIP's MAP head: a learned `probe` attends over an image's rows; then
    `x + mlp(layernorm(x))`."""

    def __init__(self, c: VisionTowerConfig):
        super().__init__()
        self.probe = nn.Parameter(torch.empty(1, 1, c.hidden_size))
        self.attention = PoolingAttention(c)
        self.layernorm = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps)
        self.mlp = EncoderMLP(c)

    def forward(self, x: torch.Tensor, layout: ImageLayout, num_images: int) -> torch.Tensor:
        pooled = self.attention(self.probe.view(-1), x, layout, num_images)
        return self.mlp(self.layernorm(pooled), pooled)


class SiglipVisionEmbeddings(nn.Module):
    def __init__(self, c: VisionTowerConfig):
        super().__init__()
        # Kept a Conv2d under the checkpoint's name; applied to patch rows as a matmul.
        self.patch_embedding = nn.Conv2d(
            c.num_channels, c.hidden_size, c.patch_size, stride=c.patch_size
        )
        self.position_embedding = nn.Embedding(c.num_patches, c.hidden_size)

    def forward(self, images: ImageBatch, layout: ImageLayout) -> torch.Tensor:
        patches = conv_patch_rows(self.patch_embedding, images.pixel_values)
        return patches + self.position_embedding(layout.attn.pos_in_seq)


class Siglip2VisionEmbeddings(nn.Module):
    def __init__(self, c: VisionTowerConfig):
        super().__init__()
        self.patch_embedding = nn.Linear(c.patch_dim, c.hidden_size)
        self.position_embedding = nn.Embedding(c.num_patches, c.hidden_size)
        self.side = round(c.num_patches**0.5)  # the position table's grid: side x side

    def forward(self, images: ImageBatch, layout: ImageLayout) -> torch.Tensor:
        patches = self.patch_embedding(images.pixel_values)
        # One resized table per distinct grid of the step, side by side; each image reads its
        # grid's, from the offset where that table starts.
        grids = list(dict.fromkeys(tuple(g) for g in images.grids))
        starts: dict[tuple[int, ...], int] = {}
        at = 0
        for rows, cols in grids:
            starts[(rows, cols)] = at
            at += rows * cols
        tables = torch.cat([self.resized_positions(rows, cols) for rows, cols in grids])
        image_starts = torch.tensor(
            [starts[tuple(g)] for g in images.grids], dtype=torch.int64, device=patches.device
        )
        attn = layout.attn
        return patches + tables[image_starts[attn.seq_ids] + attn.pos_in_seq]

    def resized_positions(self, rows: int, cols: int) -> torch.Tensor:
        """`[rows * cols, hidden]`: the position table resized to a grid of `rows` x `cols`,
        row-major, by transformers' weights (`Siglip2VisionEmbeddings.
        resize_positional_embeddings`: bilinear with antialiasing, separable), in float32."""
        table = self.position_embedding.weight  # [side * side, hidden]
        device = table.device
        sizes = torch.tensor([rows, cols], dtype=torch.float32, device=device)
        scale = self.side / sizes  # [2]: source cells per output cell, along y and x
        support = scale.clamp(min=1)
        source = torch.arange(self.side, dtype=torch.float32, device=device)

        def axis(n: int, i: int) -> torch.Tensor:  # [n, side]: each output's source weights
            center = (torch.arange(n, dtype=torch.float32, device=device) + 0.5) * scale[i] - 0.5
            weights = (1 - (source - center[:, None]).abs().div(support[i])).clamp(min=0)
            return weights / weights.sum(-1, keepdim=True)

        weights = axis(rows, 0)[:, None, :, None] * axis(cols, 1)[None, :, None, :]
        resized = weights.reshape(rows * cols, -1) @ table.float()
        return resized.to(table.dtype)


class SiglipVisionTransformer(nn.Module):
    def __init__(self, c: VisionTowerConfig, embeddings: nn.Module):
        super().__init__()
        self.embeddings = embeddings
        self.encoder = Encoder(c)
        self.post_layernorm = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps)
        self.head = MultiheadAttentionPoolingHead(c)


class SiglipModel(DualEncoder):
    """SigLIP (`SiglipModel`): texts through the text `head`, fixed-size images through the
    attention-pooling head, into one space of the vision tower's width."""

    is_causal = False
    resized_positions = False  # SigLIP2: the position table resized to each image's grid
    text_model: SiglipTextTransformer

    def __init__(self, c: SiglipConfig):
        super().__init__(c.text, c.vision, c.projection_size)
        self.config = c
        # SigLIP was trained on texts padded to its text length and pools the last position:
        # texts are padded so, as its processors are told to (padding="max_length").
        self.pad_prompts_to = c.text.max_position_embeddings
        self.pad_token_id = c.pad_token_id
        self.text_model = SiglipTextTransformer(c.text, c.projection_size)
        embeddings = (
            Siglip2VisionEmbeddings(c.vision)
            if self.resized_positions
            else SiglipVisionEmbeddings(c.vision)
        )
        self.vision_model = SiglipVisionTransformer(c.vision, embeddings)

    @classmethod
    def from_hf_config(cls, hf: dict[str, Any]) -> PoolingModel:
        return cls(SiglipConfig.from_hf(hf, resized_positions=cls.resized_positions))

    def project_text(self, rows: torch.Tensor) -> torch.Tensor:
        return self.text_model.head(rows)

    def embed_images(self, images: ImageBatch, text_attn: AttentionMetadata) -> torch.Tensor:
        if not self.resized_positions:
            check_grids(images, self.config.vision.grid, type(self).__name__)
        vision = self.vision_model
        layout = image_layout(images, text_attn, class_row=False)
        x = vision.encoder(vision.embeddings(images, layout), layout.attn)
        return vision.head(vision.post_layernorm(x), layout, images.num_images)


class Siglip2Model(SiglipModel):
    """SigLIP2 (`Siglip2Model`): SigLIP with images of any grid of patches (NaFlex), its
    position table resized to each."""

    resized_positions = True
