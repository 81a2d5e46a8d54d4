"""CLIP: a dual encoder, a causal text tower and a ViT image tower projected into one space.

Both towers are pre-norm encoders of one layer (`EncoderLayer`, Hugging Face's names:
`layer_norm1`, `self_attn.{q,k,v,out}_proj`, `layer_norm2`, `mlp.fc1/fc2`), which SigLIP
reuses. A text row's output is its final hidden state after `final_layer_norm` through
`text_projection`: the projection is linear, so applied to every row it gives at the prompt's
last row what transformers gives for the pooled one (CLIP's end-of-text token ends the prompt:
we never pad). Images run as flat variable-length sequences of patch rows, each with its class
row in front; the class row's state through `post_layernorm` and `visual_projection` is the
image's embedding, written into the image's row of the flat batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from vecpool.errors import ConfigError, InputError
from vecpool.models.base import Capability, ImageBatch, PoolingModel
from vecpool.models.layers.attention import AttentionMetadata, flat_attention
from vecpool.models.layers.basic import activation_name, linear_activation, linear_residual
from vecpool.models.layers.encoder_blocks import FusedSelfAttention

QUICK_GELU = "quick_gelu"


def quick_gelu(x: torch.Tensor) -> torch.Tensor:
    """`x * sigmoid(1.702 x)`: OpenAI CLIP's approximation of GELU (transformers' QuickGELU)."""
    return x * torch.sigmoid(1.702 * x)


# ---- configuration --------------------------------------------------------------------------


@dataclass(frozen=True)
class TowerConfig:
    """One tower's encoder: the sizes its layers read."""

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    hidden_act: str
    layer_norm_eps: float


@dataclass(frozen=True)
class TextTowerConfig(TowerConfig):
    vocab_size: int
    max_position_embeddings: int


@dataclass(frozen=True)
class VisionTowerConfig(TowerConfig):
    num_channels: int
    patch_size: int
    # The side of the square image the position table covers, in pixels; 0 where the table is
    # resized to each image's grid instead (SigLIP2, whose table covers `num_patches`).
    image_size: int
    num_patches: int  # rows of the position table

    @property
    def patch_dim(self) -> int:
        """Values of one patch row: channels * patch_size ** 2."""
        return self.num_channels * self.patch_size**2

    @property
    def grid(self) -> tuple[int, int]:
        """(rows, columns) of patches of a fixed-size image."""
        side = self.image_size // self.patch_size
        return side, side


def sub_config(hf: dict[str, Any], key: str, defaults: dict[str, Any]) -> dict[str, Any]:
    """The `text_config` / `vision_config` of a dual encoder's `config.json` as transformers
    reads it: its class's defaults (configs saved by older transformers leave out the values
    equal to them), the saved values, then the legacy `text_config_dict` / `vision_config_dict`,
    which win where they are given."""
    values = dict(defaults)
    for name in (key, f"{key}_dict"):
        given = hf.get(name)
        if given is None:
            continue
        if not isinstance(given, dict):
            raise ConfigError(f"config.json: {name!r} must be an object, got {given!r}")
        values.update({k: v for k, v in given.items() if v is not None})
    return values


def _int(values: dict[str, Any], name: str, where: str) -> int:
    value = values[name]
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"config.json: {where}.{name} must be a positive integer, got {value!r}")
    return value


def _activation(values: dict[str, Any], where: str) -> str:
    name = str(values["hidden_act"])
    if name == QUICK_GELU:
        return name
    try:
        return activation_name(name)
    except ConfigError as exc:
        raise ConfigError(f"config.json: {where}.hidden_act: {exc}") from None


def tower_fields(values: dict[str, Any], where: str) -> dict[str, Any]:
    """The `TowerConfig` fields of a sub-config (`where`: its key, for messages)."""
    fields: dict[str, Any] = {
        "hidden_size": _int(values, "hidden_size", where),
        "intermediate_size": _int(values, "intermediate_size", where),
        "num_layers": _int(values, "num_hidden_layers", where),
        "num_heads": _int(values, "num_attention_heads", where),
        "hidden_act": _activation(values, where),
        "layer_norm_eps": float(values["layer_norm_eps"]),
    }
    if fields["hidden_size"] % fields["num_heads"]:
        raise ConfigError(
            f"config.json: {where}.hidden_size {fields['hidden_size']} is not a multiple of "
            f"num_attention_heads {fields['num_heads']}"
        )
    return fields


def text_tower_config(values: dict[str, Any]) -> TextTowerConfig:
    return TextTowerConfig(
        **tower_fields(values, "text_config"),
        vocab_size=_int(values, "vocab_size", "text_config"),
        max_position_embeddings=_int(values, "max_position_embeddings", "text_config"),
    )


def vision_tower_config(values: dict[str, Any], *, resized_positions: bool) -> VisionTowerConfig:
    """A vision tower's config: a fixed square image (`image_size`), or a position table of
    `num_patches` rows resized to each image's grid (`resized_positions`, SigLIP2)."""
    where = "vision_config"
    patch = _int(values, "patch_size", where)
    if resized_positions:
        image_size, num_patches = 0, _int(values, "num_patches", where)
        side = round(num_patches**0.5)
        if side * side != num_patches:
            raise ConfigError(f"config.json: {where}.num_patches {num_patches} is not a square")
    else:
        image_size = _int(values, "image_size", where)
        if image_size % patch:
            raise ConfigError(
                f"config.json: {where}.image_size {image_size} is not a multiple of "
                f"patch_size {patch}"
            )
        num_patches = (image_size // patch) ** 2
    return VisionTowerConfig(
        **tower_fields(values, where),
        num_channels=_int(values, "num_channels", where),
        patch_size=patch,
        image_size=image_size,
        num_patches=num_patches,
    )


# transformers' CLIPTextConfig / CLIPVisionConfig defaults (openai/clip-vit-base-patch32).
CLIP_TEXT_DEFAULTS: dict[str, Any] = {
    "vocab_size": 49408,
    "hidden_size": 512,
    "intermediate_size": 2048,
    "num_hidden_layers": 12,
    "num_attention_heads": 8,
    "max_position_embeddings": 77,
    "hidden_act": QUICK_GELU,
    "layer_norm_eps": 1e-5,
}
# A ViT-B image tower, the shape CLIPVisionConfig's and SiglipVisionConfig's defaults share.
VIT_B_DEFAULTS: dict[str, Any] = {
    "hidden_size": 768,
    "intermediate_size": 3072,
    "num_hidden_layers": 12,
    "num_attention_heads": 12,
    "num_channels": 3,
    "image_size": 224,
}
CLIP_VISION_DEFAULTS: dict[str, Any] = {
    **VIT_B_DEFAULTS,
    "patch_size": 32,
    "hidden_act": QUICK_GELU,
    "layer_norm_eps": 1e-5,
}


@dataclass(frozen=True)
class CLIPConfig:
    text: TextTowerConfig
    vision: VisionTowerConfig
    projection_dim: int  # the shared space's width

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> CLIPConfig:
        vision = sub_config(hf, "vision_config", CLIP_VISION_DEFAULTS)
        return cls(
            text=text_tower_config(sub_config(hf, "text_config", CLIP_TEXT_DEFAULTS)),
            vision=vision_tower_config(vision, resized_positions=False),
            projection_dim=_int({"projection_dim": 512, **hf}, "projection_dim", "config"),
        )


# ---- the encoder both towers (and SigLIP's) are made of --------------------------------------


class EncoderAttention(FusedSelfAttention):
    """Self-attention over `q_proj`, `k_proj`, `v_proj` (one matmul once loaded), then
    `out_proj`; causal in CLIP's text tower."""

    qkv_names: ClassVar[tuple[str, str, str]] = ("q_proj", "k_proj", "v_proj")

    def __init__(self, c: TowerConfig, causal: bool):
        super().__init__(c)
        self.out_proj = nn.Linear(c.hidden_size, c.hidden_size)
        self.causal = causal

    def forward(  # type: ignore[override]
        self, x: torch.Tensor, attn: AttentionMetadata
    ) -> torch.Tensor:  # [num_tokens, hidden], before `out_proj`
        q, k, v = self.project(x)
        shape = (x.shape[0], self.num_heads, self.head_dim)
        out = flat_attention(
            q.reshape(shape),
            k.reshape(shape),
            v.reshape(shape),
            attn,
            causal=self.causal,
            scale=self.head_dim**-0.5,
        )
        return out.reshape(x.shape[0], -1)


class EncoderMLP(nn.Module):
    """`fc2(act(fc1(x)))`, added to a residual."""

    def __init__(self, c: TowerConfig):
        super().__init__()
        self.fc1 = nn.Linear(c.hidden_size, c.intermediate_size)
        self.fc2 = nn.Linear(c.intermediate_size, c.hidden_size)
        self.act = c.hidden_act

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """`residual + fc2(act(fc1(x)))`."""
        if self.act == QUICK_GELU:
            hidden = quick_gelu(self.fc1(x))
        else:
            hidden = linear_activation(self.fc1, x, self.act)
        return linear_residual(self.fc2, hidden, residual)


class EncoderLayer(nn.Module):
    """Pre-norm: `x + attention(layer_norm1(x))`, then `x + mlp(layer_norm2(x))`."""

    def __init__(self, c: TowerConfig, causal: bool = False):
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps)
        self.self_attn = EncoderAttention(c, causal)
        self.layer_norm2 = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps)
        self.mlp = EncoderMLP(c)

    def forward(self, x: torch.Tensor, attn: AttentionMetadata) -> torch.Tensor:
        x = linear_residual(self.self_attn.out_proj, self.self_attn(self.layer_norm1(x), attn), x)
        return self.mlp(self.layer_norm2(x), x)


class Encoder(nn.Module):
    def __init__(self, c: TowerConfig, causal: bool = False):
        super().__init__()
        self.layers = nn.ModuleList(EncoderLayer(c, causal) for _ in range(c.num_layers))

    def forward(self, x: torch.Tensor, attn: AttentionMetadata) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x, attn)
        return x


class TextEmbeddings(nn.Module):
    def __init__(self, c: TextTowerConfig):
        super().__init__()
        self.token_embedding = nn.Embedding(c.vocab_size, c.hidden_size)
        self.position_embedding = nn.Embedding(c.max_position_embeddings, c.hidden_size)


class TextTransformer(nn.Module):
    """A text tower: token and position embeddings, the encoder, the final norm."""

    def __init__(self, c: TextTowerConfig, causal: bool):
        super().__init__()
        self.embeddings = TextEmbeddings(c)
        self.encoder = Encoder(c, causal)
        self.final_layer_norm = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps)


# ---- images as flat sequences ----------------------------------------------------------------


@dataclass
class ImageLayout:
    """Where each image's rows lie in the vision tower's flat batch: its patches, and for CLIP
    the class row in front of them. Index arithmetic on `cu_patches`; no host sync."""

    attn: AttentionMetadata  # the tower's sequences: one per image
    # [num_rows] int64: the patch each row is; a class row: num_patches (one past the last)
    patch_rows: torch.Tensor
    first_rows: torch.Tensor  # [num_images] int64: each image's first row


def image_layout(images: ImageBatch, text_attn: AttentionMetadata, class_row: bool) -> ImageLayout:
    """The flat layout of `images` for the vision tower, `class_row` one row in front of each
    image's patches; attention runs on the text's path (varlen kernel or padded fallback)."""
    num_patches, num_images = images.pixel_values.shape[0], images.num_images
    device = images.pixel_values.device
    extra = int(class_row)
    # [num_images + 1]: the tower's boundaries, `extra` rows more per image
    cu = images.cu_patches.long() + extra * torch.arange(num_images + 1, device=device)
    num_rows = num_patches + extra * num_images
    seq_ids = torch.repeat_interleave(
        torch.arange(num_images, device=device), cu[1:] - cu[:-1], output_size=num_rows
    )
    pos_in_seq = torch.arange(num_rows, device=device) - cu[:-1][seq_ids]
    # A row's patch: its row less the class rows up to and including its image's.
    patch_rows = torch.arange(num_rows, device=device) - extra * (seq_ids + 1)
    if class_row:
        patch_rows = patch_rows.masked_fill(pos_in_seq == 0, num_patches)
    attn = AttentionMetadata(
        cu_seqlens=cu.to(torch.int32),
        max_seqlen=images.max_patches + extra,
        seq_ids=seq_ids,
        pos_in_seq=pos_in_seq,
        use_varlen=text_attn.use_varlen,
        batch_invariant=text_attn.batch_invariant,
    )
    return ImageLayout(attn=attn, patch_rows=patch_rows, first_rows=cu[:-1])


def check_grids(images: ImageBatch, grid: tuple[int, int], what: str) -> None:
    """`InputError` naming the first image whose grid of patches is not `grid` (a fixed-size
    tower's; `what` says whose)."""
    for i, image_grid in enumerate(images.grids):
        if tuple(image_grid) != grid:
            raise InputError(
                f"image {i} of the step has {image_grid[0]}x{image_grid[1]} patches; {what} "
                f"takes {grid[0]}x{grid[1]} (its image processor's size)"
            )


def conv_patch_rows(conv: nn.Conv2d, pixel_values: torch.Tensor) -> torch.Tensor:
    """`[num_patches, channels * p * p]` patch rows (each laid out (channel, y, x), as
    `vecpool.inputs.pixels` documents) -> `[num_patches, hidden]`: the Conv2d patch
    embedding, as one matrix product with its kernel."""
    weight = conv.weight.reshape(conv.weight.shape[0], -1)  # [hidden, channels * p * p]
    return nn.functional.linear(pixel_values, weight, conv.bias)


# ---- the dual encoders -----------------------------------------------------------------------


class DualEncoder(PoolingModel):
    """What CLIP and SigLIP share: a text tower under `text_model` whose rows go into the shared
    space (`project_text`), and an image tower (`embed_images`) whose pooled, projected rows
    replace the images' rows of the flat batch."""

    capabilities = frozenset({Capability.IMAGE_TOWER})
    unused_checkpoint_keys: ClassVar[tuple[str, ...]] = (
        "logit_scale",  # the contrastive loss's temperature
        "logit_bias",
        "*.embeddings.position_ids",  # older checkpoints kept the index buffers
    )
    text_model: TextTransformer

    def __init__(self, text: TextTowerConfig, vision: VisionTowerConfig, output_size: int):
        super().__init__()
        self.hidden_size = text.hidden_size
        self.vocab_size = text.vocab_size
        self.max_positions = text.max_position_embeddings
        self.output_size = output_size
        self.image_patch_dim = vision.patch_dim
        self.image_grid = vision.grid if vision.image_size else None

    @property
    def default_pooler(self) -> str:
        """The last row: CLIP's end-of-text token, the row SigLIP pools."""
        return "LAST"

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.text_model.embeddings.token_embedding(input_ids)

    def forward(
        self,
        inputs_embeds: torch.Tensor,  # [num_tokens, hidden]
        positions: torch.Tensor,  # [num_tokens] int64
        attn: AttentionMetadata,
        token_type_ids: torch.Tensor | None = None,  # unused: no token types
        images: ImageBatch | None = None,
    ) -> torch.Tensor:  # [num_tokens, output_size]
        text = self.text_model
        x = inputs_embeds + text.embeddings.position_embedding(positions)
        x = text.final_layer_norm(text.encoder(x, attn))
        out = self.project_text(x)
        if images is not None and images.num_images:
            pooled = self.embed_images(images, attn)  # [num_images, output_size]
            out.index_copy_(0, images.rows, pooled.to(out.dtype))
        return out

    def project_text(self, rows: torch.Tensor) -> torch.Tensor:
        """`[n, hidden]` text rows after the final norm -> `[n, output_size]`."""
        raise NotImplementedError

    def embed_images(self, images: ImageBatch, text_attn: AttentionMetadata) -> torch.Tensor:
        """`[num_images, output_size]`: each image's embedding in the shared space."""
        raise NotImplementedError


class CLIPTextTransformer(TextTransformer):
    def __init__(self, c: TextTowerConfig):
        super().__init__(c, causal=True)


class CLIPVisionEmbeddings(nn.Module):
    def __init__(self, c: VisionTowerConfig):
        super().__init__()
        self.class_embedding = nn.Parameter(torch.empty(c.hidden_size))
        # Kept a Conv2d under the checkpoint's name; applied to patch rows as a matmul.
        self.patch_embedding = nn.Conv2d(
            c.num_channels, c.hidden_size, c.patch_size, stride=c.patch_size, bias=False
        )
        self.position_embedding = nn.Embedding(c.num_patches + 1, c.hidden_size)


class CLIPVisionTransformer(nn.Module):
    def __init__(self, c: VisionTowerConfig):
        super().__init__()
        self.embeddings = CLIPVisionEmbeddings(c)
        self.pre_layrnorm = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps)  # sic
        self.encoder = Encoder(c)
        self.post_layernorm = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps)


class CLIPModel(DualEncoder):
    """CLIP (`CLIPModel`): texts and images into one space of `projection_dim`."""

    is_causal = True  # the text tower's attention

    def __init__(self, c: CLIPConfig):
        super().__init__(c.text, c.vision, c.projection_dim)
        self.config = c
        self.text_model = CLIPTextTransformer(c.text)
        self.vision_model = CLIPVisionTransformer(c.vision)
        self.text_projection = nn.Linear(c.text.hidden_size, c.projection_dim, bias=False)
        self.visual_projection = nn.Linear(c.vision.hidden_size, c.projection_dim, bias=False)

    @classmethod
    def from_hf_config(cls, hf: dict[str, Any]) -> PoolingModel:
        return cls(CLIPConfig.from_hf(hf))

    def project_text(self, rows: torch.Tensor) -> torch.Tensor:
        return self.text_projection(rows)

    def embed_images(self, images: ImageBatch, text_attn: AttentionMetadata) -> torch.Tensor:
        check_grids(images, self.config.vision.grid, "CLIPModel")
        vision = self.vision_model
        emb = vision.embeddings
        layout = image_layout(images, text_attn, class_row=True)
        patches = conv_patch_rows(emb.patch_embedding, images.pixel_values)
        # The class embedding as one more source row, after the patches.
        sources = torch.cat([patches, emb.class_embedding[None].to(patches.dtype)])
        x = sources[layout.patch_rows] + emb.position_embedding(layout.attn.pos_in_seq)
        x = vision.encoder(vision.pre_layrnorm(x), layout.attn)
        pooled = vision.post_layernorm(x[layout.first_rows])  # the class rows
        return self.visual_projection(pooled)
