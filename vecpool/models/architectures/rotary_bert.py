"""The post-norm BERT with rotary positions that NomicBERT and GTE ("new") both are: one encoder
under each checkpoint family's names, as vLLM's `bert_with_rope.py` serves them from one class.

Word embeddings (plus token types where the config has them) and a LayerNorm; then layers of
`norm1(x + attention(x))`, `norm2(x + mlp(x))`. Attention runs through one packed q|k|v
projection, rotary on q and k (GPT-NeoX halves, not interleaved); the MLP is gated,
`down(up * act(gate))`, its up and gate halves from one projection (GTE's `up_gate_proj`) or
two that are joined once the weights load (NomicBERT's `fc11`, `fc12`). A family is a config
reading (`RotaryBertConfig`) and its names for the parts (`RotaryBertNames`), under which the
modules are built so that its checkpoint loads as it is.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, ClassVar, cast

import torch
from torch import nn

from vecpool.errors import ConfigError
from vecpool.models.architectures.encoder import EncoderModel, register_at
from vecpool.models.base import PoolingModel
from vecpool.models.layers.attention import AttentionMetadata
from vecpool.models.layers.basic import Rotary, activation, fuse
from vecpool.models.layers.encoder_blocks import PackedRotaryAttention


@dataclass(frozen=True)
class RotaryBertConfig:
    """The encoder's shape and options, as a family's config reading gives them."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int
    gate_act: str  # the activation of the MLP's gate (an `activation` name)
    max_positions: int
    type_vocab_size: int  # 0: no token types
    layer_norm_eps: float
    rope_theta: float
    num_labels: int
    ntk_factor: float | None = None  # NTK-scaled rotary (GTE's rope_scaling {"type": "ntk"})
    ntk_mixed_b: float | None = None  # its optional "mixed_b"
    qkv_bias: bool = True  # biases of the projections
    out_bias: bool = True
    up_gate_bias: bool = True
    down_bias: bool = True

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


@dataclass(frozen=True)
class RotaryBertNames:
    """A checkpoint family's names for the encoder's parts (paths below the base model)."""

    embedding_norm: str  # the LayerNorm after the embeddings
    layers: str  # the layer stack
    attention: str  # in a layer: the attention block, its norm, the MLP's norm
    attention_norm: str
    mlp_norm: str
    qkv: str  # in the attention block: the packed q|k|v projection, the output projection
    out: str
    up_gate: tuple[str, ...]  # in the MLP: one projection of both halves, or up and gate
    down: str


def check_settings(family: str, settings: dict[str, tuple[Any, Any]]) -> None:
    """Raise `ConfigError` naming the first config key whose value (first of each pair) is not
    the one supported (second)."""
    for key, (value, supported) in settings.items():
        if value != supported:
            raise ConfigError(f"{family} {key}={value!r} is not supported (only {supported!r})")


def rotary_table(c: RotaryBertConfig) -> Rotary:
    """The rotary table: the plain one, or the NTK-scaled one of GTE's
    `NTKScalingRotaryEmbedding`.

    NTK scaling takes effect whenever the factor exceeds 1 (the reference builds its table for
    `max_position_embeddings * factor` positions at start): without `mixed_b`, frequencies of a
    base `theta * factor` divided by `factor ** (2 / head_dim)`; with it, the base frequencies
    divided by `exp(a * m ** mixed_b)`, `a = log(factor) / (head_dim / 2) ** mixed_b`.
    """
    dim = c.head_dim
    factor = c.ntk_factor if c.ntk_factor is not None and c.ntk_factor > 1 else None
    theta = c.rope_theta * factor if factor is not None and c.ntk_mixed_b is None else c.rope_theta
    rotary = Rotary(dim, {"rope_theta": theta})
    if factor is not None and c.ntk_mixed_b is None:
        rotary.inv_freq = rotary.inv_freq / factor ** (2 / dim)
    elif factor is not None and c.ntk_mixed_b is not None:
        a = torch.tensor(factor, device="cpu").log() / (dim / 2) ** c.ntk_mixed_b
        m = torch.arange(1, dim // 2 + 1, dtype=torch.int64, device="cpu").float()
        rotary.inv_freq = rotary.inv_freq / (a * m**c.ntk_mixed_b).exp()
    return rotary


class RotaryBertMLP(nn.Module):
    """`down(up * act(gate))`, up and gate the two halves of `up_gate`: the checkpoint's one
    projection of both, or its two (up, gate) joined once the weights load."""

    def __init__(self, c: RotaryBertConfig, names: RotaryBertNames):
        super().__init__()
        self.names = names
        self.act = activation(c.gate_act)
        width = c.intermediate_size * (3 - len(names.up_gate))  # both halves in one, or one each
        for name in names.up_gate:
            self.add_module(name, nn.Linear(c.hidden_size, width, bias=c.up_gate_bias))
        self.add_module(names.down, nn.Linear(c.intermediate_size, c.hidden_size, bias=c.down_bias))
        self.up_gate: nn.Module | None = None

    def fuse_projections(self) -> None:
        names = list(self.names.up_gate)
        if len(names) > 1:
            fuse(self, "up_gate", names)
        else:  # the checkpoint's one projection, under the name `forward` reads
            self.up_gate = getattr(self, names[0])
            delattr(self, names[0])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        assert self.up_gate is not None, "projections are fused when the weights load"
        both = self.up_gate(x)
        up, gate = both if isinstance(both, tuple) else both.chunk(2, dim=-1)
        return getattr(self, self.names.down)(up * self.act(gate))


class RotaryBertLayer(nn.Module):
    """Post-norm: `attention_norm(x + attention(x))`, then `mlp_norm(x + mlp(x))`."""

    def __init__(self, c: RotaryBertConfig, names: RotaryBertNames):
        super().__init__()
        self.names = names
        attention = PackedRotaryAttention(
            c.hidden_size, c.num_heads, (names.qkv, names.out), (c.qkv_bias, c.out_bias)
        )
        self.add_module(names.attention, attention)
        self.mlp = RotaryBertMLP(c, names)
        for norm in (names.attention_norm, names.mlp_norm):
            self.add_module(norm, nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps))

    def forward(
        self, x: torch.Tensor, attn: AttentionMetadata, cos: torch.Tensor, sin: torch.Tensor
    ) -> torch.Tensor:
        n = self.names
        x = getattr(self, n.attention_norm)(x + getattr(self, n.attention)(x, cos, sin, attn))
        return getattr(self, n.mlp_norm)(x + self.mlp(x))


class RotaryBertEmbeddings(nn.Module):
    def __init__(self, c: RotaryBertConfig):
        super().__init__()
        self.word_embeddings = nn.Embedding(c.vocab_size, c.hidden_size)
        self.token_type_embeddings: nn.Embedding | None = None
        if c.type_vocab_size > 0:
            self.token_type_embeddings = nn.Embedding(c.type_vocab_size, c.hidden_size)


class RotaryBertModel(EncoderModel):
    """The encoder under a family's `names`: `embeddings`, the embedding norm, the layers."""

    names: ClassVar[RotaryBertNames]
    embeddings: RotaryBertEmbeddings

    def __init__(self, c: RotaryBertConfig):
        super().__init__(c, c.max_positions, c.type_vocab_size)
        self.config = c
        self.rotary = rotary_table(c)
        self.embeddings = RotaryBertEmbeddings(c)
        n = self.names
        register_at(self, n.embedding_norm, nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps))
        register_at(
            self, n.layers, nn.ModuleList(RotaryBertLayer(c, n) for _ in range(c.num_layers))
        )

    @classmethod
    def config_from_hf(cls, hf: dict[str, Any]) -> RotaryBertConfig:
        """The family's reading of its config.json."""
        raise NotImplementedError

    @classmethod
    def from_hf_config(cls, hf: dict[str, Any]) -> PoolingModel:
        return cls(cls.config_from_hf(hf))

    def embed(
        self, inputs_embeds: torch.Tensor, positions: torch.Tensor, types: torch.Tensor | None
    ) -> torch.Tensor:
        token_types = self.embeddings.token_type_embeddings
        x = inputs_embeds if token_types is None else inputs_embeds + token_types(types)
        return cast(torch.Tensor, self.get_submodule(self.names.embedding_norm)(x))

    def layer_stack(self) -> Iterable[nn.Module]:
        return cast(nn.ModuleList, self.get_submodule(self.names.layers))

    def layer_inputs(
        self, x: torch.Tensor, positions: torch.Tensor, attn: AttentionMetadata
    ) -> tuple[torch.Tensor, ...]:
        return self.rotary.cos_sin(positions, x.dtype)  # [num_tokens, head_dim] each
