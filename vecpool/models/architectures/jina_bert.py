"""Jina BERT v2 (jina-embeddings-v2, jina-reranker-v1): BERT with ALiBi and a gated MLP.

Its code ships with the checkpoints (`auto_map`, never run here); this is a native port of the
published definitions. No position embeddings: every layer adds the symmetric ALiBi bias
`-slope_h * |i - j|` to its attention logits, through `flat_attention(..., bias=)`. Two layouts
exist, told apart by the checkpoint's tensors:
- jina-bert-implementation (v2-small/base-en, -de, -es, -zh, reranker-v1): the MLP is
  `gated_layers` (act of the first half times the second), `wo`, and its own post-norm
  `layernorm` over the residual.
- jina-bert-v2-qk-post-norm (v2-base-code): LayerNorms on the query and key projections
  (`layer_norm_q` / `layer_norm_k`), an MLP `up_gated_layer` (the first half times act of the
  second) and `down_layer`, and the layer's own norms `layer_norm_1` (over the input plus the
  attention block's output) and `layer_norm_2` (over that plus the MLP).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from vecpool.errors import ConfigError
from vecpool.models.architectures.bert import BertConfig, BertEmbeddings
from vecpool.models.architectures.encoder import EncoderModel
from vecpool.models.architectures.encoder_heads import PooledSequenceClassifier
from vecpool.models.base import PoolingModel
from vecpool.models.layers.attention import AttentionMetadata
from vecpool.models.layers.encoder_blocks import DenseNorm, FusedSelfAttention

_QK_NORM_KEY = "encoder.layer.0.attention.self.layer_norm_q.weight"
_GLU_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "geglu": F.gelu,  # exact, as nn.GELU()
    "reglu": F.relu,
}


@dataclass(frozen=True)
class JinaBertConfig(BertConfig):
    """BERT's sizes, without position embeddings, and the MLP's layout."""

    feed_forward_type: str = "geglu"  # or "reglu"
    qk_post_norm: bool = False  # the jina-bert-v2-qk-post-norm layout

    @classmethod
    def from_hf(cls, hf: dict[str, Any], position_offset: int = 0) -> JinaBertConfig:
        position_type = hf.get("position_embedding_type", "absolute")
        if position_type != "alibi":
            raise ConfigError(
                f"position_embedding_type {position_type!r}: Jina BERT v2 is supported with "
                "'alibi' only (a BERT with absolute positions is BertModel)"
            )
        feed_forward = hf.get("feed_forward_type", "original")
        if feed_forward not in _GLU_ACTIVATIONS:
            raise ConfigError(f"feed_forward_type {feed_forward!r} is not supported (geglu, reglu)")
        return cls.read(
            hf,
            defaults={"max_position_embeddings": 8192},
            absolute_positions=False,
            feed_forward_type=feed_forward,
            qk_post_norm=bool(hf.get("checkpoint_shapes")),
        )


def alibi_slopes(num_heads: int) -> list[float]:
    """ALiBi's per-head slopes: a geometric series from 2^(-8/n) for a power of two `n`; for
    other head counts, those of the power of two below, then every other slope of the power of
    two above (as the published code builds them)."""

    def power_of_two(n: int) -> list[float]:
        start = 2 ** (-(2 ** -(math.log2(n) - 3)))
        return [start * start**i for i in range(n)]

    if math.log2(num_heads).is_integer():
        return power_of_two(num_heads)
    below = 2 ** math.floor(math.log2(num_heads))
    return power_of_two(below) + alibi_slopes(2 * below)[0::2][: num_heads - below]


class JinaBertSelfAttention(FusedSelfAttention):
    """BERT's `query`, `key`, `value`, ALiBi as the bias, and in the qk-post-norm layout
    `layer_norm_q` / `layer_norm_k` over all heads at once, before the split into heads."""

    def __init__(self, c: JinaBertConfig):
        super().__init__(c)
        self.qk_post_norm = c.qk_post_norm
        if c.qk_post_norm:
            self.layer_norm_q = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps)
            self.layer_norm_k = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps)

    def forward(
        self, x: torch.Tensor, attn: AttentionMetadata, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        q, k, v = self.project(x)
        if self.qk_post_norm:
            q, k = self.layer_norm_q(q), self.layer_norm_k(k)
        return self.attend(q, k, v, attn, bias)


class JinaBertAttention(nn.Module):
    def __init__(self, c: JinaBertConfig):
        super().__init__()
        self.self = JinaBertSelfAttention(c)
        self.output = DenseNorm(c.hidden_size, c)

    def forward(
        self, x: torch.Tensor, attn: AttentionMetadata, alibi: torch.Tensor
    ) -> torch.Tensor:
        return self.output(self.self(x, attn, alibi), x)


class JinaBertGLUMLP(nn.Module):
    """jina-bert-implementation: `layernorm(wo(act(gate) * up) + x)`, gate the first half of
    `gated_layers`."""

    def __init__(self, c: JinaBertConfig):
        super().__init__()
        self.intermediate_size = c.intermediate_size
        self.gated_layers = nn.Linear(c.hidden_size, 2 * c.intermediate_size, bias=False)
        self.wo = nn.Linear(c.intermediate_size, c.hidden_size)
        self.layernorm = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps)
        self.act = _GLU_ACTIVATIONS[c.feed_forward_type]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gated_layers(x).split(self.intermediate_size, dim=-1)
        return self.layernorm(self.wo(self.act(gate) * up) + x)


class JinaBertQKNormMLP(nn.Module):
    """jina-bert-v2-qk-post-norm: `down_layer(up * act(gate))`, gate the second half of
    `up_gated_layer`; the residual and norm are the layer's."""

    def __init__(self, c: JinaBertConfig):
        super().__init__()
        self.intermediate_size = c.intermediate_size
        self.up_gated_layer = nn.Linear(c.hidden_size, 2 * c.intermediate_size, bias=False)
        self.down_layer = nn.Linear(c.intermediate_size, c.hidden_size)
        self.act = _GLU_ACTIVATIONS[c.feed_forward_type]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        up, gate = self.up_gated_layer(x).split(self.intermediate_size, dim=-1)
        return self.down_layer(up * self.act(gate))


class JinaBertLayer(nn.Module):
    def __init__(self, c: JinaBertConfig):
        super().__init__()
        self.attention = JinaBertAttention(c)
        self.qk_post_norm = c.qk_post_norm
        self.mlp: nn.Module
        if c.qk_post_norm:
            self.layer_norm_1 = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps)
            self.layer_norm_2 = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps)
            self.mlp = JinaBertQKNormMLP(c)
        else:
            self.mlp = JinaBertGLUMLP(c)

    def forward(
        self, x: torch.Tensor, attn: AttentionMetadata, alibi: torch.Tensor
    ) -> torch.Tensor:
        h = self.attention(x, attn, alibi)
        if not self.qk_post_norm:
            return self.mlp(h)
        h = self.layer_norm_1(x + h)
        return self.layer_norm_2(h + self.mlp(h))


class JinaBertEncoder(nn.Module):
    def __init__(self, c: JinaBertConfig):
        super().__init__()
        self.layer = nn.ModuleList(JinaBertLayer(c) for _ in range(c.num_layers))


class JinaBertModel(EncoderModel):
    """Jina BERT v2 (`JinaBertModel`, and `JinaBertForMaskedLM`, the name jina-embeddings-v2
    folders give their bare model; its masked-LM head and BERT pooler, when stored, are
    unused). Mean pooling when the folder does not say, as the models are trained."""

    checkpoint_prefixes = ("bert.",)
    pooling = "MEAN"
    shape_keys = (_QK_NORM_KEY, f"bert.{_QK_NORM_KEY}")
    unused_checkpoint_keys: ClassVar[tuple[str, ...]] = (
        "pooler.*",
        "cls.*",
        "embeddings.position_ids",
        "embeddings.token_type_ids",
    )

    def __init__(self, c: JinaBertConfig):
        super().__init__(c, c.max_position_embeddings, c.type_vocab_size)
        self.config = c
        self.embeddings = BertEmbeddings(c)  # no position embeddings: ALiBi
        self.encoder = JinaBertEncoder(c)
        # Real values, not parameters: on the CPU, as models are built on the meta device.
        self._slopes = torch.tensor(alibi_slopes(c.num_heads), device="cpu")  # [heads] float32
        self._device_slopes: torch.Tensor | None = None

    @classmethod
    def from_hf_config(cls, hf: dict[str, Any]) -> PoolingModel:
        return cls(JinaBertConfig.from_hf(hf))

    def layer_inputs(
        self, x: torch.Tensor, positions: torch.Tensor, attn: AttentionMetadata
    ) -> tuple[torch.Tensor, ...]:
        """The step's ALiBi bias, `-slope_h * |i - j|` below `max_seqlen` (`[1, heads, L, L]`)."""
        slopes = self._device_slopes
        if slopes is None or slopes.device != x.device:
            slopes = self._device_slopes = self._slopes.to(x.device)
        pos = torch.arange(attn.max_seqlen, device=x.device)
        distance = (pos[None, :] - pos[:, None]).abs()  # [L, L]
        return ((-slopes[:, None, None] * distance).unsqueeze(0).to(x.dtype),)


class JinaBertForSequenceClassification(PooledSequenceClassifier, JinaBertModel):
    """The first row through BERT's pooler (dense, tanh), then `classifier` (jina-reranker-v1
    cross-encoders). CLS pooling, as BERT's classifier reads."""

    pooling = "CLS"
    unused_checkpoint_keys: ClassVar[tuple[str, ...]] = (
        "cls.*",
        "embeddings.position_ids",
        "embeddings.token_type_ids",
    )
