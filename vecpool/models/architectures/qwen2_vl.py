"""Qwen2-VL and Qwen2.5-VL: a vision tower whose rows take the place of each image's
placeholder tokens in the prompt's input embeddings, then Qwen2's decoder with multimodal
rotary positions (M-RoPE). Embedders built on them (GME) pool its last row.

The vision tower (`visual`, with transformers' names) reads the patch rows of
`vecpool.inputs.image_processing` ("qwen2_vl"): the Conv3d patch embedding as one matrix
product, pre-norm blocks whose attention rotates each head's first half by the patch's row and
its second half by its column (a 2-D rotary embedding, in float32 as transformers does), and the
patch merger (a norm, each `merge_size**2` neighbouring patches side by side, a two-layer MLP)
into the language model's width. Qwen2-VL's blocks: LayerNorm, a QuickGELU MLP. Qwen2.5-VL's:
RMSNorm, a gated SiLU MLP with biases, and attention within windows of `window_size` pixels
except in `fullatt_block_indexes`: its patches are reordered window after window, merge block
by merge block, and the merger's rows put back in order. Every image is one sequence of the
tower's flat batch (bidirectional, variable length, as a flat batch of texts): a step's images
of different sizes run together, unpadded.

The decoder's rotary frequencies are split in three sections (`mrope_section`), turned by a
token's temporal, height and width positions: `[3, num_tokens]` positions, which the input
stage computes (`vecpool.inputs.vision_prompts.mrope_positions`) and the flat batch carries for
steps that hold an image. Where the three are equal, as for every text, that is the plain
rotary embedding: a step of texts runs on the one-row positions, as any decoder's.

The model runner writes the tower's rows (`vision_rows`) into the input embeddings before the
language model runs: once per image, even where the prompt runs in chunks and a chunk boundary
splits the image's placeholders (`vecpool.runner.image_rows`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from vecpool.errors import ConfigError, EngineError
from vecpool.models.architectures.clip import quick_gelu
from vecpool.models.architectures.decoder import DecoderConfig, DecoderForCausalLM, read_config
from vecpool.models.architectures.qwen3 import qwen_sliding_layers
from vecpool.models.base import Capability, ImageBatch, PoolingModel
from vecpool.models.hf import hf_get
from vecpool.models.layers.attention import AttentionMetadata, flat_attention
from vecpool.models.layers.basic import GatedMLP, RMSNorm, Rotary, activation, apply_rotary

# transformers' Qwen2VLTextConfig defaults, for keys a config.json leaves out.
_TEXT_DEFAULTS: dict[str, Any] = {
    "hidden_act": "silu",
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 32768,
    "tie_word_embeddings": False,
}
_DEFAULT_MROPE_SECTION = (16, 24, 24)
_VISION_EPS = 1e-6  # the tower's norms (fixed in transformers)


# ---- configuration --------------------------------------------------------------------------


@dataclass(frozen=True)
class VisionConfig:
    """The vision tower's shape, read once from `vision_config`."""

    depth: int
    width: int  # the tower's hidden size (Qwen2-VL's `embed_dim`)
    num_heads: int
    intermediate_size: int
    hidden_act: str
    in_channels: int
    patch_size: int
    temporal_patch_size: int
    merge_size: int
    out_size: int  # the merger's output: the language model's width
    rope_theta: float
    gated: bool  # Qwen2.5-VL: RMSNorm and a gated MLP with biases
    window_size: int  # Qwen2.5-VL's attention windows, in pixels; 0: none
    full_attention_blocks: frozenset[int]  # blocks that attend to the whole image

    @property
    def head_dim(self) -> int:
        return self.width // self.num_heads

    @property
    def patch_dim(self) -> int:
        """Values of one patch row: channels * frames * patch_size**2."""
        return self.in_channels * self.temporal_patch_size * self.patch_size**2

    @property
    def merge_unit(self) -> int:
        """Patches per language-model row."""
        return self.merge_size**2


def text_fields(hf: dict[str, Any]) -> dict[str, Any]:
    """The language model's config: `text_config` over the top level (configs saved before
    transformers 5 hold it at the top level)."""
    nested = hf.get("text_config")
    text = {k: v for k, v in hf.items() if k not in ("text_config", "vision_config")}
    if isinstance(nested, dict):
        text.update({k: v for k, v in nested.items() if v is not None})
        # transformers ties the embeddings where either level says so
        text["tie_word_embeddings"] = bool(hf.get("tie_word_embeddings")) or bool(
            nested.get("tie_word_embeddings")
        )
    return text


def vision_config(hf: dict[str, Any], qwen2_5: bool) -> VisionConfig:
    """The tower's config, with transformers' defaults (Qwen2VLVisionConfig /
    Qwen2_5_VLVisionConfig) for what `vision_config` leaves out."""
    v = hf.get("vision_config")
    if not isinstance(v, dict):
        raise ConfigError("config.json: a vision-language model needs a vision_config object")

    def number(key: str, default: int) -> int:
        value = v.get(key, default)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(
                f"config.json: vision_config.{key} must be a positive integer, got {value!r}"
            )
        return value

    rope = v.get("rope_parameters") or {}
    theta = float(hf_get(rope, "rope_theta", default=v.get("rope_theta", 10000.0)))
    channels = number("in_channels", v.get("in_chans", 3))
    # What the two towers name or default differently: Qwen2.5-VL's gated blocks and windows.
    family: dict[str, Any]
    if qwen2_5:
        width = number("hidden_size", 3584)
        blocks = v.get("fullatt_block_indexes", (7, 15, 23, 31))
        family = dict(
            intermediate_size=number("intermediate_size", 3420),
            hidden_act=str(v.get("hidden_act", "silu")),
            out_size=number("out_hidden_size", 3584),
            gated=True,
            window_size=number("window_size", 112),
            full_attention_blocks=frozenset(int(b) for b in blocks),
        )
    else:
        width = number("embed_dim", 1280)
        family = dict(
            intermediate_size=width * number("mlp_ratio", 4),
            hidden_act=str(v.get("hidden_act", "quick_gelu")),
            out_size=number("hidden_size", 3584),
            gated=False,
            window_size=0,
            full_attention_blocks=frozenset(),
        )
    c = VisionConfig(
        depth=number("depth", 32),
        width=width,
        num_heads=number("num_heads", 16),
        in_channels=channels,
        patch_size=number("patch_size", 14),
        temporal_patch_size=number("temporal_patch_size", 2),
        merge_size=number("spatial_merge_size", 2),
        rope_theta=theta,
        **family,
    )
    unit = c.patch_size * c.merge_size
    if c.window_size and c.window_size < unit:
        raise ConfigError(
            f"config.json: vision_config.window_size {c.window_size} is less than one merge "
            f"block ({unit} pixels)"
        )
    if c.width % c.num_heads or c.head_dim % 4:
        raise ConfigError(
            f"config.json: vision_config's width {c.width} over {c.num_heads} heads must give a "
            "head size that is a multiple of 4 (its 2-D rotary embedding)"
        )
    if c.hidden_act != "quick_gelu":
        activation(c.hidden_act)  # ConfigError for an unknown one
    return c


# ---- multimodal rotary positions ------------------------------------------------------------


class MRopeRotary(Rotary):
    """Qwen2-VL's rotary embedding: `[3, num_tokens]` positions turn the frequency pairs of
    `mrope_section`'s three parts by the temporal, height and width position in turn, as
    transformers' `Qwen2VLRotaryEmbedding` (the same float32 products, so equal to the bit);
    `[num_tokens]` positions are the plain rotary embedding (all three axes equal)."""

    def __init__(self, head_dim: int, text: dict[str, Any]):
        params = {**(text.get("rope_scaling") or {}), **(text.get("rope_parameters") or {})}
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type not in ("default", "mrope"):
            raise ConfigError(f"rope type {rope_type!r} is not supported with M-RoPE (default)")
        theta = hf_get(params, "rope_theta", default=text.get("rope_theta", 1000000.0))
        super().__init__(head_dim, {"rope_parameters": {"rope_theta": float(theta)}})
        section = tuple(int(n) for n in params.get("mrope_section", _DEFAULT_MROPE_SECTION))
        if sum(section) != head_dim // 2 or len(section) != 3:
            raise ConfigError(
                f"mrope_section {list(section)} must be three parts summing to head_dim / 2 = "
                f"{head_dim // 2}"
            )
        # [head_dim / 2] int64: the axis (temporal, height, width) that turns each frequency
        axes = [axis for axis, count in enumerate(section) for _ in range(count)]
        self.axes = torch.tensor(axes, dtype=torch.int64, device="cpu")
        self._device_axes: torch.Tensor | None = None

    def cos_sin(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`[num_tokens, head_dim]` cos and sin for `[num_tokens]` or `[3, num_tokens]`
        positions, in `dtype`."""
        if positions.ndim == 1:
            return super().cos_sin(positions, dtype)
        axes, inv_freq = self._device_axes, self._device_inv_freq
        if axes is None or inv_freq is None or axes.device != positions.device:
            self._device_axes = axes = self.axes.to(positions.device)
            self._device_inv_freq = inv_freq = self.inv_freq.to(positions.device)
        # [num_tokens, head_dim / 2]: frequency j turned by its axis's position
        freqs = positions.float()[axes].t() * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)


# ---- the vision tower -----------------------------------------------------------------------


class PatchEmbed(nn.Module):
    def __init__(self, c: VisionConfig):
        super().__init__()
        kernel = (c.temporal_patch_size, c.patch_size, c.patch_size)
        # Kept a Conv3d under the checkpoint's name; applied to patch rows as a matmul.
        self.proj = nn.Conv3d(c.in_channels, c.width, kernel, stride=kernel, bias=False)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """`[num_patches, patch_dim]` rows laid out (channel, frame, y, x) -> `[num_patches,
        width]`."""
        weight = self.proj.weight.reshape(self.proj.weight.shape[0], -1)
        return F.linear(pixel_values, weight)


class VisionAttention(nn.Module):
    """Bidirectional attention of each image (or window) with itself, q/k/v in one `qkv`."""

    def __init__(self, c: VisionConfig):
        super().__init__()
        self.num_heads, self.head_dim = c.num_heads, c.head_dim
        self.qkv = nn.Linear(c.width, 3 * c.width)
        self.proj = nn.Linear(c.width, c.width)

    def forward(
        self,
        x: torch.Tensor,  # [num_patches, width]
        cos: torch.Tensor,  # [num_patches, head_dim] float32
        sin: torch.Tensor,  # [num_patches, head_dim] float32
        attn: AttentionMetadata,
    ) -> torch.Tensor:  # [num_patches, width]
        n = x.shape[0]
        q, k, v = self.qkv(x).view(n, 3, self.num_heads, self.head_dim).unbind(1)
        # The rotation in float32, as transformers' `apply_rotary_pos_emb_vision`.
        q = apply_rotary(q.float(), cos, sin).to(x.dtype)
        k = apply_rotary(k.float(), cos, sin).to(x.dtype)
        out = flat_attention(q, k, v, attn, causal=False, scale=self.head_dim**-0.5)
        return self.proj(out.reshape(n, -1))


class VisionMLP(nn.Module):
    """Qwen2-VL's `fc2(act(fc1(x)))` (QuickGELU)."""

    def __init__(self, c: VisionConfig):
        super().__init__()
        self.fc1 = nn.Linear(c.width, c.intermediate_size)
        self.fc2 = nn.Linear(c.intermediate_size, c.width)
        self.act = quick_gelu if c.hidden_act == "quick_gelu" else activation(c.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


def _norm(c: VisionConfig, width: int) -> nn.Module:
    return RMSNorm(width, _VISION_EPS) if c.gated else nn.LayerNorm(width, eps=_VISION_EPS)


class VisionBlock(nn.Module):
    """Pre-norm: `x + attn(norm1(x))`, then `x + mlp(norm2(x))`."""

    def __init__(self, c: VisionConfig):
        super().__init__()
        self.norm1 = _norm(c, c.width)
        self.norm2 = _norm(c, c.width)
        self.attn = VisionAttention(c)
        self.mlp: nn.Module = (
            GatedMLP(c.width, c.intermediate_size, c.hidden_act, bias=True)
            if c.gated
            else VisionMLP(c)
        )

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: AttentionMetadata
    ) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, attn)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """Each `merge_size**2` neighbouring patches (consecutive rows) normed, side by side,
    through `mlp` into the language model's width."""

    def __init__(self, c: VisionConfig):
        super().__init__()
        self.merged = c.width * c.merge_unit
        self.ln_q = _norm(c, c.width)
        self.mlp = nn.Sequential(
            nn.Linear(self.merged, self.merged), nn.GELU(), nn.Linear(self.merged, c.out_size)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [n, width] -> [n / unit, out_size]
        return self.mlp(self.ln_q(x).view(-1, self.merged))


@dataclass
class VisionLayout:
    """A step's images laid out for the tower (host arithmetic on their grids, one upload)."""

    positions: torch.Tensor  # [num_patches, 2] int64: each patch's (row, column)
    images: AttentionMetadata  # one sequence per image
    # Qwen2.5-VL: windows, and the merge blocks' order window by window (None without).
    windows: AttentionMetadata | None
    window_order: torch.Tensor | None  # [num_patches / unit] int64: block at each place
    restore_order: torch.Tensor | None  # [num_patches / unit] int64: its inverse


class VisionTower(nn.Module):
    """`visual`: patch embedding, blocks, merger (see the module docstring)."""

    def __init__(self, c: VisionConfig):
        super().__init__()
        self.config = c
        self.patch_embed = PatchEmbed(c)
        self.blocks = nn.ModuleList(VisionBlock(c) for _ in range(c.depth))
        self.merger = PatchMerger(c)
        # [head_dim / 4] float32, on the CPU explicitly: models are built on the meta device,
        # and these are real values, not parameters the loader fills.
        quarter = c.head_dim // 2
        exponents = torch.arange(0, quarter, 2, dtype=torch.float32, device="cpu") / quarter
        self.inv_freq = 1.0 / (c.rope_theta**exponents)

    def forward(
        self,
        pixel_values: torch.Tensor,  # [num_patches, patch_dim]
        grids: list[tuple[int, int]],
        use_varlen: bool,
        batch_invariant: bool = False,
    ) -> torch.Tensor:
        """`[num_patches, patch_dim]` patch rows of images of `grids` -> `[num_patches /
        merge_size**2, out_size]`, image after image."""
        c = self.config
        layout = vision_layout(c, grids, pixel_values.device, use_varlen, batch_invariant)
        x = self.patch_embed(pixel_values)
        # [num_patches, head_dim] float32: the row's angles, then the column's, twice over
        freqs = layout.positions.float()[:, :, None] * self.inv_freq.to(x.device)
        half = freqs.flatten(1)
        emb = torch.cat((half, half), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        order = layout.window_order
        if order is not None:  # merge blocks window after window (their patches together)
            x, cos, sin = (_by_block(t, order, c.merge_unit) for t in (x, cos, sin))
        for i, block in enumerate(self.blocks):
            windowed = layout.windows is not None and i not in c.full_attention_blocks
            x = block(x, cos, sin, layout.windows if windowed else layout.images)
        out = self.merger(x)
        if layout.restore_order is not None:
            out = out[layout.restore_order]
        return out


def _by_block(t: torch.Tensor, order: torch.Tensor, unit: int) -> torch.Tensor:
    """Rows of `t` reordered by merge block (`unit` consecutive rows each) as `order` says."""
    return t.view(-1, unit, t.shape[-1])[order].view(t.shape)


def vision_layout(
    c: VisionConfig,
    grids: list[tuple[int, int]],
    device: torch.device,
    use_varlen: bool,
    batch_invariant: bool,
) -> VisionLayout:
    """Patch positions, the images' sequences and (Qwen2.5-VL) windows, as transformers'
    `get_vision_position_ids` / `get_vision_window_index` make them."""
    m = c.merge_size
    positions, image_lengths = [], []
    window_order: list[np.ndarray] = []
    window_lengths: list[np.ndarray] = []
    blocks_before = 0
    side = c.window_size // m // c.patch_size  # merge blocks per window side
    for rows, cols in grids:
        if rows % m or cols % m:
            raise EngineError(f"an image of {rows}x{cols} patches is not whole {m}x{m} blocks")
        r, q = np.meshgrid(np.arange(rows), np.arange(cols), indexing="ij")
        by_block = (rows // m, m, cols // m, m)
        positions.append(
            np.stack(
                [a.reshape(by_block).transpose(0, 2, 1, 3).reshape(-1) for a in (r, q)], axis=1
            )
        )
        image_lengths.append(rows * cols)
        if c.window_size:
            br, bc = rows // m, cols // m  # merge blocks
            index = np.full((-(-br // side) * side, -(-bc // side) * side), -1, dtype=np.int64)
            index[:br, :bc] = np.arange(br * bc).reshape(br, bc)
            nh, nw = index.shape[0] // side, index.shape[1] // side
            by_window = index.reshape(nh, side, nw, side).transpose(0, 2, 1, 3).reshape(nh * nw, -1)
            counts = (by_window >= 0).sum(axis=1)
            window_order.append(by_window[by_window >= 0] + blocks_before)
            window_lengths.append(counts[counts > 0] * c.merge_unit)
            blocks_before += br * bc

    def metadata(lengths: np.ndarray) -> AttentionMetadata:
        cu = np.zeros(len(lengths) + 1, dtype=np.int64)
        np.cumsum(lengths, out=cu[1:])
        seq_ids = np.repeat(np.arange(len(lengths)), lengths)
        return AttentionMetadata(
            cu_seqlens=torch.from_numpy(cu).to(device=device, dtype=torch.int32),
            max_seqlen=int(lengths.max()),
            seq_ids=torch.from_numpy(seq_ids).to(device),
            pos_in_seq=torch.from_numpy(np.arange(int(cu[-1])) - cu[:-1][seq_ids]).to(device),
            use_varlen=use_varlen,
            batch_invariant=batch_invariant,
        )

    windows = order = restore = None
    if c.window_size:
        flat = np.concatenate(window_order)
        windows = metadata(np.concatenate(window_lengths))
        order = torch.from_numpy(flat).to(device)
        restore = torch.from_numpy(np.argsort(flat)).to(device)
    return VisionLayout(
        positions=torch.from_numpy(np.concatenate(positions)).to(device),
        images=metadata(np.array(image_lengths, dtype=np.int64)),
        windows=windows,
        window_order=order,
        restore_order=restore,
    )


# ---- the models -----------------------------------------------------------------------------


class Qwen2VLForConditionalGeneration(DecoderForCausalLM):
    """Qwen2-VL: `visual` and Qwen2's decoder (with its `lm_head`). Checkpoints load in
    transformers 5's layout (`model.visual.`, `model.language_model.`) and the earlier one
    (`visual.`, `model.`) that the published checkpoints (GME among them) use."""

    # (the decoder's one prefix is typed as a 1-tuple)
    checkpoint_prefixes = ("model.language_model.", "model.", "language_model.")  # type: ignore[assignment]
    capabilities = frozenset({Capability.CAUSAL_LM, Capability.IMAGE_TOWER})
    qwen2_5: ClassVar[bool] = False

    def __init__(self, c: DecoderConfig, rotary: MRopeRotary, vision: VisionConfig):
        super().__init__(c, rotary)
        if vision.out_size != c.hidden_size:
            raise ConfigError(
                f"config.json: the vision tower's output width {vision.out_size} is not the "
                f"language model's hidden_size {c.hidden_size}"
            )
        self.visual = VisionTower(vision)
        self.image_patch_dim = vision.patch_dim
        self.image_grid = None  # any size: the processor resizes to whole merge blocks

    @classmethod
    def from_hf_config(cls, hf: dict[str, Any]) -> PoolingModel:
        return cls(*cls.read_parts(hf))

    @classmethod
    def read_parts(cls, hf: dict[str, Any]) -> tuple[DecoderConfig, MRopeRotary, VisionConfig]:
        """The language model's config, its rotary embedding and the tower's config, from a
        Qwen2-VL `config.json` dict (a retrieval model's `vlm_config`)."""
        text = text_fields(hf)
        layer_types, window = qwen_sliding_layers(text)
        c = read_config(
            text,
            defaults=_TEXT_DEFAULTS,
            layer_types=layer_types,
            sliding_window=window,
            qkv_bias=True,
        )
        return c, MRopeRotary(c.head_dim, text), vision_config(hf, cls.qwen2_5)

    def drop_parameter(self, name: str) -> None:
        super().drop_parameter(name)
        self.capabilities = self.capabilities | {Capability.IMAGE_TOWER}

    def vision_rows(
        self, images: ImageBatch, use_varlen: bool, batch_invariant: bool = False
    ) -> torch.Tensor:  # [num_image_tokens, hidden]
        """The rows of the images' placeholder tokens, image after image."""
        rows = self.visual(images.pixel_values, images.grids, use_varlen, batch_invariant)
        if images.rows.shape[0] not in (0, rows.shape[0]):
            raise EngineError(
                f"the step's images give {rows.shape[0]} rows for {images.rows.shape[0]} "
                "placeholder tokens"
            )
        return rows


class Qwen2VLModel(Qwen2VLForConditionalGeneration):
    """Qwen2-VL's base model (`visual`, `language_model`): no `lm_head`."""

    capabilities = frozenset({Capability.IMAGE_TOWER})
    tied_weights: ClassVar[dict[str, str]] = {}
    optional_parameters = ()  # type: ignore[assignment]  # the decoder's is a 1-tuple
    unused_checkpoint_keys: ClassVar[tuple[str, ...]] = ("*.rotary_emb.inv_freq", "lm_head.*")

    def __init__(self, c: DecoderConfig, rotary: MRopeRotary, vision: VisionConfig):
        super().__init__(c, rotary, vision)
        self.lm_head = None
        self.tie_word_embeddings = False


class Qwen2_5_VLForConditionalGeneration(Qwen2VLForConditionalGeneration):
    """Qwen2.5-VL: Qwen2-VL with windowed attention, RMSNorm and gated MLPs in its tower."""

    qwen2_5 = True


class Qwen2_5_VLModel(Qwen2VLModel):
    """Qwen2.5-VL's base model: no `lm_head`."""

    qwen2_5 = True
