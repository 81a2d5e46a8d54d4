"""DeBERTa-v2 / v3 encoders: post-norm BERT layers with disentangled attention.

Besides content-to-content logits, a query attends to the relative position of each key
(c2p: the query against projected relative-position embeddings) and a key to the relative
position of each query (p2c). Those terms depend on q and k, so they are computed here in the
padded `[num_seqs, heads, max_len, max_len]` layout (rows placed by `seq_ids` / `pos_in_seq`, as
the attention fallback places them) and handed to `flat_attention` as its additive bias; the
biased attention then runs the exact padded path. Relative positions are log-bucketed by the
checkpoint's `position_buckets` and `max_relative_positions`, as the reference does.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from vecpool.errors import ConfigError
from vecpool.models.architectures.bert import BertAttention, BertLayer
from vecpool.models.architectures.encoder import EncoderModel
from vecpool.models.architectures.encoder_heads import (
    LMHeadNames,
    MaskedLM,
    PooledSequenceClassifier,
    TokenClassifier,
)
from vecpool.models.base import PoolingModel, hf_num_labels
from vecpool.models.layers.attention import AttentionMetadata, GraphUnsupported, flat_attention
from vecpool.models.layers.basic import FusedProjections, activation, activation_name, fuse
from vecpool.models.layers.invariant import tiled_matmul

_POS_ATT_TYPES = ("c2p", "p2c")


@dataclass(frozen=True)
class DebertaV2Config:
    """A DeBERTa-v2 model's shape and options, read once from its Hugging Face config
    (transformers' defaults where a key is absent)."""

    vocab_size: int
    hidden_size: int
    embedding_size: int
    num_layers: int
    num_heads: int
    head_dim: int
    intermediate_size: int
    hidden_act: str
    max_position_embeddings: int
    type_vocab_size: int
    layer_norm_eps: float
    position_biased_input: bool  # absolute position embeddings added to the input
    relative_attention: bool
    pos_att_type: tuple[str, ...]  # of "c2p", "p2c"
    share_att_key: bool  # positions projected by query_proj / key_proj themselves
    position_buckets: int  # <= 0: no log buckets
    max_relative_positions: int
    norm_rel_ebd: bool  # LayerNorm on the relative embeddings
    pooler_hidden_size: int
    pooler_hidden_act: str
    num_labels: int

    @property
    def att_span(self) -> int:
        """Relative positions each side of zero that have an embedding row."""
        return self.position_buckets if self.position_buckets > 0 else self.max_relative_positions

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> DebertaV2Config:
        if int(hf.get("conv_kernel_size") or 0) > 0:
            raise ConfigError(
                f"conv_kernel_size {hf['conv_kernel_size']} (DeBERTa's convolution layer) is not "
                "supported"
            )
        pos_att_type = hf.get("pos_att_type") or []
        if isinstance(pos_att_type, str):
            pos_att_type = [t.strip() for t in pos_att_type.lower().split("|")]
        unknown = [t for t in pos_att_type if t not in _POS_ATT_TYPES]
        if unknown:
            raise ConfigError(f"pos_att_type {unknown} is not supported (only c2p, p2c)")
        norm_rel_ebd = [t.strip() for t in str(hf.get("norm_rel_ebd", "none")).lower().split("|")]
        if any(t not in ("none", "layer_norm") for t in norm_rel_ebd):
            raise ConfigError(f"norm_rel_ebd {hf['norm_rel_ebd']!r} is not supported")
        hidden = hf["hidden_size"]
        heads = hf["num_attention_heads"]
        max_positions = hf.get("max_position_embeddings", 512)
        max_relative = int(hf.get("max_relative_positions", -1))
        c = cls(
            vocab_size=hf["vocab_size"],
            hidden_size=hidden,
            embedding_size=hf.get("embedding_size") or hidden,
            num_layers=hf["num_hidden_layers"],
            num_heads=heads,
            head_dim=hf.get("attention_head_size") or hidden // heads,
            intermediate_size=hf["intermediate_size"],
            hidden_act=hf.get("hidden_act", "gelu"),
            max_position_embeddings=max_positions,
            type_vocab_size=hf.get("type_vocab_size", 0),
            layer_norm_eps=hf.get("layer_norm_eps", 1e-7),
            position_biased_input=bool(hf.get("position_biased_input", True)),
            relative_attention=bool(hf.get("relative_attention", False)),
            pos_att_type=tuple(pos_att_type),
            share_att_key=bool(hf.get("share_att_key", False)),
            position_buckets=int(hf.get("position_buckets", -1)),
            max_relative_positions=max_relative if max_relative >= 1 else max_positions,
            norm_rel_ebd="layer_norm" in norm_rel_ebd,
            pooler_hidden_size=hf.get("pooler_hidden_size", hidden),
            pooler_hidden_act=hf.get("pooler_hidden_act", "gelu"),
            num_labels=hf_num_labels(hf),
        )
        if c.embedding_size > c.hidden_size:
            raise ConfigError(
                f"embedding_size {c.embedding_size} is larger than hidden_size {hidden}; "
                "factorized embeddings are served up to the hidden size"
            )
        activation_name(c.hidden_act)
        activation_name(c.pooler_hidden_act)
        return c


def relative_positions(length: int, c: DebertaV2Config, device: torch.device) -> torch.Tensor:
    """`[length, length]` int64: query position minus key position, log-bucketed beyond half
    of `position_buckets` as DeBERTa does (same float32 arithmetic, so the same buckets)."""
    pos = torch.arange(length, dtype=torch.long, device=device)
    rel = pos[:, None] - pos[None, :]
    if c.position_buckets <= 0 or c.max_relative_positions <= 0:
        return rel
    mid = c.position_buckets // 2
    sign = torch.sign(rel)
    near = (rel < mid) & (rel > -mid)
    distance = torch.where(near, torch.full_like(rel, mid - 1), rel.abs())
    log_ratio = torch.log(torch.tensor((c.max_relative_positions - 1) / mid, device=device))
    log_pos = torch.ceil(torch.log(distance / mid) / log_ratio * (mid - 1)) + mid
    return torch.where(distance <= mid, rel.to(log_pos.dtype), log_pos * sign).to(torch.long)


class DebertaV2Embeddings(nn.Module):
    def __init__(self, c: DebertaV2Config):
        super().__init__()
        self.word_embeddings = nn.Embedding(c.vocab_size, c.embedding_size)
        if c.position_biased_input:
            self.position_embeddings = nn.Embedding(c.max_position_embeddings, c.embedding_size)
        if c.type_vocab_size > 0:
            self.token_type_embeddings = nn.Embedding(c.type_vocab_size, c.embedding_size)
        if c.embedding_size != c.hidden_size:
            self.embed_proj = nn.Linear(c.embedding_size, c.hidden_size, bias=False)
        self.LayerNorm = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps)
        self.config = c

    def forward(
        self, inputs_embeds: torch.Tensor, positions: torch.Tensor, types: torch.Tensor | None
    ) -> torch.Tensor:
        # Same order of additions as the reference, so that results match to the last bit.
        x = inputs_embeds[:, : self.config.embedding_size]  # the lookup's own columns
        if self.config.position_biased_input:
            x = x + self.position_embeddings(positions)
        if self.config.type_vocab_size > 0:
            x = x + self.token_type_embeddings(types)
        if self.config.embedding_size != self.config.hidden_size:
            x = self.embed_proj(x)
        return self.LayerNorm(x)


class DisentangledSelfAttention(nn.Module):
    def __init__(self, c: DebertaV2Config):
        super().__init__()
        self.num_heads = c.num_heads
        self.head_dim = c.head_dim
        inner = c.num_heads * c.head_dim
        self.query_proj = nn.Linear(c.hidden_size, inner)
        self.key_proj = nn.Linear(c.hidden_size, inner)
        self.value_proj = nn.Linear(c.hidden_size, inner)
        self.relative = c.relative_attention and bool(c.pos_att_type)
        self.pos_att_type = c.pos_att_type
        self.share_att_key = c.share_att_key
        self.att_span = c.att_span
        if c.relative_attention and not c.share_att_key:
            if "c2p" in c.pos_att_type:
                self.pos_key_proj = nn.Linear(c.hidden_size, inner)
            if "p2c" in c.pos_att_type:
                self.pos_query_proj = nn.Linear(c.hidden_size, inner)
        # The content logits and each relative term are divided by sqrt(head_dim * terms).
        self.scale_divisor = math.sqrt(c.head_dim * (1 + len(c.pos_att_type)))
        self.qkv: FusedProjections | None = None

    def fuse_projections(self) -> None:
        fuse(self, "qkv", ["query_proj", "key_proj", "value_proj"])

    def _heads(self, x: torch.Tensor) -> torch.Tensor:  # [n, inner] -> [heads, n, head_dim]
        return x.view(x.shape[0], self.num_heads, self.head_dim).transpose(0, 1)

    def _padded(
        self, name: str, x: torch.Tensor, attn: AttentionMetadata
    ) -> torch.Tensor:  # [T, H, D] -> [B, H, L, D]
        shape = torch.Size((attn.num_seqs, attn.max_seqlen, *x.shape[1:]))
        padded = attn.padded_buffer(name, shape, x)
        padded[attn.seq_ids, attn.pos_in_seq] = x
        return padded.transpose(1, 2)

    def relative_bias(
        self,
        q: torch.Tensor,  # [T, H, D]
        k: torch.Tensor,  # [T, H, D]
        attn: AttentionMetadata,
        rel_embeddings: torch.Tensor,  # [2 * att_span, hidden], normed if the config says
        rel_pos: torch.Tensor,  # [L, L] int64: bucketed query position - key position
    ) -> torch.Tensor:  # [B, H, L, L]: c2p + p2c, already divided by the scale
        assert self.qkv is not None
        span = self.att_span
        rel = rel_embeddings[: 2 * span]
        if self.share_att_key:
            pos_query, pos_key, _ = self.qkv(rel)
        else:
            pos_query = self.pos_query_proj(rel) if "p2c" in self.pos_att_type else rel
            pos_key = self.pos_key_proj(rel) if "c2p" in self.pos_att_type else rel
        qp = self._padded("rel_q", q, attn)  # [B, H, L, D]
        kp = self._padded("rel_k", k, attn)
        shape = (*qp.shape[:3], rel_pos.shape[-1])  # [B, H, L, L]
        score = torch.zeros((), dtype=q.dtype, device=q.device)
        if "c2p" in self.pos_att_type:
            # Query i against the embedding of its offset to key j.
            # [B, H, L, 2 span]; fixed row tiles in the batch-invariant mode
            c2p = tiled_matmul(qp, self._heads(pos_key).transpose(-1, -2), attn.batch_invariant)
            index = torch.clamp(rel_pos + span, 0, 2 * span - 1)
            score = score + torch.gather(c2p, -1, index.expand(shape)) / self.scale_divisor
        if "p2c" in self.pos_att_type:
            # Key j against the embedding of query i's offset to it, gathered by key rows.
            # [B, H, L, 2 span]
            p2c = tiled_matmul(kp, self._heads(pos_query).transpose(-1, -2), attn.batch_invariant)
            index = torch.clamp(-rel_pos + span, 0, 2 * span - 1)
            p2c = torch.gather(p2c, -1, index.expand(shape)).transpose(-1, -2)
            score = score + p2c / self.scale_divisor
        return score

    def forward(
        self,
        x: torch.Tensor,
        attn: AttentionMetadata,
        rel_embeddings: torch.Tensor | None = None,  # without relative attention: none
        rel_pos: torch.Tensor | None = None,
    ) -> torch.Tensor:
        shape = (x.shape[0], self.num_heads, self.head_dim)
        assert self.qkv is not None, "projections are fused when the weights load"
        q, k, v = (t.view(shape) for t in self.qkv(x))
        bias = None
        if self.relative and rel_embeddings is not None and rel_pos is not None:
            if attn.static:  # before writing the padded layout, which a replay would not see
                raise GraphUnsupported("DeBERTa's disentangled attention runs padded")
            bias = self.relative_bias(q, k, attn, rel_embeddings, rel_pos)
        out = flat_attention(q, k, v, attn, causal=False, scale=1 / self.scale_divisor, bias=bias)
        return out.reshape(x.shape[0], -1)


def deberta_v2_layer(c: DebertaV2Config) -> BertLayer:
    """BERT's post-norm layer around the disentangled self-attention."""
    attention = BertAttention(c, DisentangledSelfAttention(c), width=c.num_heads * c.head_dim)
    return BertLayer(c, attention)


class DebertaV2Encoder(nn.Module):
    def __init__(self, c: DebertaV2Config):
        super().__init__()
        self.layer = nn.ModuleList(deberta_v2_layer(c) for _ in range(c.num_layers))
        if c.relative_attention:
            self.rel_embeddings = nn.Embedding(2 * c.att_span, c.hidden_size)
            if c.norm_rel_ebd:
                self.LayerNorm = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps)


class DebertaV2Model(EncoderModel):
    """DeBERTa-v2 / v3 (`DebertaV2Model`): hidden states of every token; CLS pooling unless the
    folder says otherwise."""

    checkpoint_prefixes = ("deberta.",)
    embeddings: DebertaV2Embeddings
    unused_checkpoint_keys: ClassVar[tuple[str, ...]] = (
        "embeddings.position_ids",
        # Kept in some checkpoints whose config turns absolute positions off (as transformers).
        "embeddings.position_embeddings.weight",
    )

    def __init__(self, c: DebertaV2Config):
        super().__init__(c, c.max_position_embeddings, c.type_vocab_size)
        self.config = c
        self.embeddings = DebertaV2Embeddings(c)
        self.encoder = DebertaV2Encoder(c)

    @classmethod
    def from_hf_config(cls, hf: dict[str, Any]) -> PoolingModel:
        return cls(DebertaV2Config.from_hf(hf))

    def layer_inputs(
        self, x: torch.Tensor, positions: torch.Tensor, attn: AttentionMetadata
    ) -> tuple[torch.Tensor, ...]:
        """With relative attention, the relative embeddings (`[2 * att_span, hidden]`, normed
        if the config says) and the step's bucketed relative positions (`[L, L]`)."""
        c = self.config
        if not c.relative_attention:
            return ()
        rel_embeddings = self.encoder.rel_embeddings.weight
        if c.norm_rel_ebd:
            rel_embeddings = self.encoder.LayerNorm(rel_embeddings)
        return rel_embeddings, relative_positions(attn.max_seqlen, c, x.device)


class DebertaV2ForSequenceClassification(PooledSequenceClassifier, DebertaV2Model):
    """The first row through the context pooler (`pooler.dense`, `pooler_hidden_act`), then
    `classifier` (NLI and quality classifiers, mxbai-rerank-v1 cross-encoders)."""

    def __init__(self, c: DebertaV2Config):
        if c.pooler_hidden_size != c.hidden_size:
            raise ConfigError(
                f"pooler_hidden_size {c.pooler_hidden_size} differs from hidden_size "
                f"{c.hidden_size}: the context pooler reads the hidden states"
            )
        super().__init__(c)
        self.classifier_activation = activation(c.pooler_hidden_act)


class DebertaV2ForTokenClassification(TokenClassifier, DebertaV2Model):
    """`classifier` on every token row."""


class DebertaV2ForMaskedLM(MaskedLM, DebertaV2Model):
    """DeBERTa-v2 with its masked-LM head: vocabulary logits per token row (SPLADE). The head
    is transformers' legacy `cls.predictions` (to the embedding width, then the tied decoder)
    unless the config sets `legacy: false`, then `lm_predictions.lm_head`, which always reads
    the word embeddings (with a bias of its own)."""

    # The replaced-token-detection head of pre-training checkpoints (as transformers).
    unused_checkpoint_keys: ClassVar[tuple[str, ...]] = (
        *DebertaV2Model.unused_checkpoint_keys,
        "mask_predictions.*",
    )
    LEGACY_HEAD = LMHeadNames.bert_layout("cls.predictions", "transform.")
    tied_weights = LEGACY_HEAD.ties()  # the other head reads the embeddings themselves
    HEAD = LMHeadNames(
        dense="lm_predictions.lm_head.dense",
        norm="lm_predictions.lm_head.LayerNorm",
        decoder=None,
        bias="lm_predictions.lm_head.bias",
    )

    def __init__(self, c: DebertaV2Config, legacy: bool, tied: bool):
        if not legacy and c.embedding_size != c.hidden_size:
            raise ConfigError(
                "legacy: false (lm_predictions) needs embedding_size equal to hidden_size"
            )
        self.lm_names = self.LEGACY_HEAD if legacy else self.HEAD  # read as the head is built
        super().__init__(c)
        self.tie_word_embeddings = tied and legacy

    @classmethod
    def from_hf_config(cls, hf: dict[str, Any]) -> PoolingModel:
        return cls(
            DebertaV2Config.from_hf(hf),
            legacy=bool(hf.get("legacy", True)),
            tied=bool(hf.get("tie_word_embeddings", True)),
        )
