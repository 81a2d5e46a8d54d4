"""T5 encoders (sentence-t5, GTR): pre-norm RMS layers, relative position buckets, no scaling.

The relative attention bias comes from the first block's bucket table and serves every layer:
one `[1, heads, max_len, max_len]` tensor per forward, added to the attention logits through
`flat_attention(..., bias=)`. Attention logits are not scaled (T5 folds the scale into its
query weights). A `T5Model` or `T5ForConditionalGeneration` folder loads its encoder only; the
decoder and language-model head stay unused.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar, cast

import torch
from torch import nn

from vecpool.errors import ConfigError
from vecpool.models.architectures.encoder import EncoderModel
from vecpool.models.base import PoolingModel
from vecpool.models.hf import hf_get
from vecpool.models.layers.attention import AttentionMetadata, flat_attention
from vecpool.models.layers.basic import FusedProjections, RMSNorm, activation, activation_name, fuse


@dataclass(frozen=True)
class T5Config:
    """A T5 encoder's shape, read once from its Hugging Face config (transformers' defaults
    where a key is absent, as `save_pretrained` leaves defaults out)."""

    vocab_size: int
    d_model: int
    d_kv: int
    d_ff: int
    num_layers: int
    num_heads: int
    num_buckets: int
    max_distance: int
    layer_norm_eps: float
    gated: bool  # "gated-<act>": act(wi_0(x)) * wi_1(x); else act(wi(x))
    act: str
    max_positions: int

    @property
    def hidden_size(self) -> int:
        return self.d_model

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> T5Config:
        proj = str(hf.get("feed_forward_proj") or "relu")
        parts = proj.split("-")
        if len(parts) > 2 or (len(parts) == 2 and parts[0] != "gated"):
            raise ConfigError(
                f"feed_forward_proj {proj!r} is not supported: expected '<act>' or 'gated-<act>'"
            )
        # transformers reads "gated-gelu" as the tanh approximation (T5 v1.1, sentence-t5).
        act = "gelu_new" if proj == "gated-gelu" else parts[-1]
        activation_name(act)  # ConfigError naming it if unknown
        return cls(
            vocab_size=hf.get("vocab_size", 32128),
            d_model=hf.get("d_model", 512),
            d_kv=hf.get("d_kv", 64),
            d_ff=hf.get("d_ff", 2048),
            num_layers=hf.get("num_layers", 6),
            num_heads=hf.get("num_heads", 8),
            num_buckets=hf.get("relative_attention_num_buckets", 32),
            max_distance=hf.get("relative_attention_max_distance", 128),
            layer_norm_eps=hf.get("layer_norm_epsilon", 1e-6),
            gated=len(parts) == 2,
            act=act,
            # Relative buckets do not bound the length; the tokenizers of T5 checkpoints do.
            max_positions=int(hf_get(hf, "n_positions", default=512)),
        )


def relative_position_bucket(
    relative: torch.Tensor, num_buckets: int, max_distance: int
) -> torch.Tensor:
    """Bidirectional T5 buckets of `relative` (key position - query position), int64: half the
    buckets for keys after the query; within each half, exact distances below a quarter of the
    buckets and logarithmic bins up to `max_distance`."""
    half = num_buckets // 2
    bucket = (relative > 0).to(torch.long) * half
    distance = relative.abs()
    exact = half // 2
    # log(0) is -inf here, but those entries take the exact branch.
    log_bin = exact + (
        torch.log(distance.float() / exact) / math.log(max_distance / exact) * (half - exact)
    ).to(torch.long)
    log_bin = torch.clamp(log_bin, max=half - 1)
    return bucket + torch.where(distance < exact, distance, log_bin)


class T5Attention(nn.Module):
    def __init__(self, c: T5Config, has_relative_attention_bias: bool):
        super().__init__()
        self.num_heads = c.num_heads
        self.head_dim = c.d_kv
        self.num_buckets = c.num_buckets
        self.max_distance = c.max_distance
        inner = c.num_heads * c.d_kv
        self.q = nn.Linear(c.d_model, inner, bias=False)
        self.k = nn.Linear(c.d_model, inner, bias=False)
        self.v = nn.Linear(c.d_model, inner, bias=False)
        self.o = nn.Linear(inner, c.d_model, bias=False)
        if has_relative_attention_bias:
            self.relative_attention_bias = nn.Embedding(c.num_buckets, c.num_heads)
        self.qkv: FusedProjections | None = None

    def fuse_projections(self) -> None:
        fuse(self, "qkv", ["q", "k", "v"])

    def position_bias(self, length: int) -> torch.Tensor:  # [1, heads, length, length]
        """The bias of query `i` and key `j` of any sequence, for positions below `length`."""
        table: torch.Tensor = self.relative_attention_bias.weight  # [num_buckets, heads]
        pos = torch.arange(length, device=table.device)
        buckets = relative_position_bucket(
            pos[None, :] - pos[:, None], self.num_buckets, self.max_distance
        )  # [length, length]
        return table[buckets].permute(2, 0, 1).contiguous().unsqueeze(0)  # rows of keys

    def forward(self, x: torch.Tensor, attn: AttentionMetadata, bias: torch.Tensor) -> torch.Tensor:
        shape = (x.shape[0], self.num_heads, self.head_dim)
        assert self.qkv is not None, "projections are fused when the weights load"
        q, k, v = (t.view(shape) for t in self.qkv(x))
        out = flat_attention(q, k, v, attn, causal=False, scale=1.0, bias=bias)
        return self.o(out.reshape(x.shape[0], -1))


class T5LayerSelfAttention(nn.Module):
    def __init__(self, c: T5Config, has_relative_attention_bias: bool):
        super().__init__()
        self.SelfAttention = T5Attention(c, has_relative_attention_bias)
        self.layer_norm = RMSNorm(c.d_model, c.layer_norm_eps)

    def forward(self, x: torch.Tensor, attn: AttentionMetadata, bias: torch.Tensor) -> torch.Tensor:
        return x + self.SelfAttention(self.layer_norm(x), attn, bias)


class T5DenseActDense(nn.Module):
    def __init__(self, c: T5Config):
        super().__init__()
        self.wi = nn.Linear(c.d_model, c.d_ff, bias=False)
        self.wo = nn.Linear(c.d_ff, c.d_model, bias=False)
        self.act = activation(c.act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.wo(self.act(self.wi(x)))


class T5DenseGatedActDense(nn.Module):
    def __init__(self, c: T5Config):
        super().__init__()
        self.wi_0 = nn.Linear(c.d_model, c.d_ff, bias=False)
        self.wi_1 = nn.Linear(c.d_model, c.d_ff, bias=False)
        self.wo = nn.Linear(c.d_ff, c.d_model, bias=False)
        self.act = activation(c.act)
        self.wi: FusedProjections | None = None

    def fuse_projections(self) -> None:
        fuse(self, "wi", ["wi_0", "wi_1"])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        assert self.wi is not None, "projections are fused when the weights load"
        gate, linear = self.wi(x)
        return self.wo(self.act(gate) * linear)


class T5LayerFF(nn.Module):
    def __init__(self, c: T5Config):
        super().__init__()
        self.DenseReluDense = T5DenseGatedActDense(c) if c.gated else T5DenseActDense(c)
        self.layer_norm = RMSNorm(c.d_model, c.layer_norm_eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.DenseReluDense(self.layer_norm(x))


class T5Block(nn.Module):
    def __init__(self, c: T5Config, has_relative_attention_bias: bool):
        super().__init__()
        self.layer = nn.ModuleList(
            [T5LayerSelfAttention(c, has_relative_attention_bias), T5LayerFF(c)]
        )

    def forward(self, x: torch.Tensor, attn: AttentionMetadata, bias: torch.Tensor) -> torch.Tensor:
        return self.layer[1](self.layer[0](x, attn, bias))


class T5Stack(nn.Module):
    def __init__(self, c: T5Config):
        super().__init__()
        # Tied to `shared` (transformers always ties them): one tensor once loaded.
        self.embed_tokens = nn.Embedding(c.vocab_size, c.d_model)
        self.block = nn.ModuleList(T5Block(c, i == 0) for i in range(c.num_layers))
        self.final_layer_norm = RMSNorm(c.d_model, c.layer_norm_eps)

    def position_bias(self, length: int) -> torch.Tensor:  # [1, heads, length, length]
        """The first block's relative attention bias, which every block adds."""
        first = cast(T5LayerSelfAttention, cast(T5Block, self.block[0]).layer[0])
        return first.SelfAttention.position_bias(length)


class T5EncoderModel(EncoderModel):
    """The encoder of a T5 checkpoint: `T5EncoderModel`, or the encoder half of a `T5Model` /
    `T5ForConditionalGeneration` folder. Pools by mean when the folder does not say (the
    pooling of sentence-t5 and GTR; T5 has no CLS token)."""

    tied_weights: ClassVar[dict[str, str]] = {"encoder.embed_tokens.weight": "shared.weight"}
    tie_word_embeddings = True
    pooling = "MEAN"
    unused_checkpoint_keys: ClassVar[tuple[str, ...]] = ("decoder.*", "lm_head.*")

    def __init__(self, c: T5Config):
        super().__init__(c, c.max_positions)
        self.config = c
        self.shared = nn.Embedding(c.vocab_size, c.d_model)
        self.encoder = T5Stack(c)

    @classmethod
    def from_hf_config(cls, hf: dict[str, Any]) -> PoolingModel:
        return cls(T5Config.from_hf(hf))

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.shared(input_ids)

    def embed(
        self, inputs_embeds: torch.Tensor, positions: torch.Tensor, types: torch.Tensor | None
    ) -> torch.Tensor:
        return inputs_embeds  # the rows as they are: no positions, no token types

    def layer_stack(self) -> nn.ModuleList:
        return self.encoder.block

    def layer_inputs(
        self, x: torch.Tensor, positions: torch.Tensor, attn: AttentionMetadata
    ) -> tuple[torch.Tensor, ...]:
        return (self.encoder.position_bias(attn.max_seqlen),)  # [1, heads, max_len, max_len]

    def final(self, x: torch.Tensor) -> torch.Tensor:
        return self.encoder.final_layer_norm(x)
