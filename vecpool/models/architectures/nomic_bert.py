"""NomicBERT (`NomicBertModel`, `model_type: nomic_bert`): nomic-embed-text-v1 / v1.5.

A post-norm BERT with rotary positions (GPT-NeoX style halves, not interleaved), a fused `Wqkv`,
a gated MLP (`fc2(fc11(x) * act(fc12(x)))`: SwiGLU in the published checkpoints), and no biases
where the config turns them off (`qkv_proj_bias`, `mlp_fc1_bias`, `mlp_fc2_bias`). Its config
keeps GPT-2's names (`n_embd`, `n_layer`, `n_head`, `n_inner`, `n_positions`). The published code
lives in the model repositories (remote code); this is written from it and never runs it.

The folder's prompts (`search_query: `, `search_document: `) come from
config_sentence_transformers.json and matryoshka truncation is the `dimensions` option, both
handled outside the model.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from vecpool.errors import ConfigError
from vecpool.models.architectures.encoder import EncoderModel
from vecpool.models.base import PoolingModel
from vecpool.models.layers.attention import AttentionMetadata
from vecpool.models.layers.basic import FusedProjections, Rotary, fuse
from vecpool.models.layers.encoder_blocks import packed_rotary_attention

# The gated activations: the gate (fc12's output) goes through this, as in the reference.
_GATES: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "swiglu": F.silu,
    "geglu": F.gelu,
    "glu": torch.sigmoid,
}


@dataclass(frozen=True)
class NomicBertConfig:
    vocab_size: int  # padded to a multiple of pad_vocab_size_multiple, as the checkpoint is
    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int
    activation: str  # a key of _GATES
    max_positions: int
    type_vocab_size: int
    layer_norm_eps: float
    rotary_base: float
    qkv_bias: bool
    fc1_bias: bool
    fc2_bias: bool

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> NomicBertConfig:
        # GPT2Config's defaults and the published NomicBertConfig's, for keys a config omits.
        checks = {
            "prenorm": (hf.get("prenorm", False), False),
            "causal": (hf.get("causal", False), False),
            "rotary_emb_fraction": (float(hf.get("rotary_emb_fraction", 0.0)), 1.0),
            "rotary_emb_interleaved": (hf.get("rotary_emb_interleaved", False), False),
            "rotary_emb_scale_base": (hf.get("rotary_emb_scale_base"), None),
            "use_rms_norm": (hf.get("use_rms_norm", False), False),
            "parallel_block": (hf.get("parallel_block", False), False),
            "norm_mlp": (hf.get("norm_mlp", False), False),
            "moe_every_n_layers": (int(hf.get("moe_every_n_layers") or 0), 0),
        }
        for key, (value, supported) in checks.items():
            if value != supported:
                raise ConfigError(
                    f"NomicBERT {key}={value!r} is not supported (only {supported!r})"
                )
        act = str(hf.get("activation_function", "gelu_new"))
        if act not in _GATES:
            raise ConfigError(
                f"NomicBERT activation_function {act!r} is not supported ({', '.join(_GATES)})"
            )
        hidden, heads = int(hf["n_embd"]), int(hf["n_head"])
        if hidden % heads:
            raise ConfigError(f"n_embd={hidden} is not a multiple of n_head={heads}")
        kv_heads = hf.get("num_heads_kv")
        if kv_heads is not None and int(kv_heads) != heads:
            raise ConfigError(
                f"NomicBERT num_heads_kv={kv_heads} (grouped queries) is not supported"
            )
        inner = hf.get("n_inner")
        if inner is None:  # the reference's default: 8/3 of the width, up to a multiple of 256
            inner = (int(8 * hidden / 3) + 255) // 256 * 256
        vocab, multiple = int(hf["vocab_size"]), int(hf.get("pad_vocab_size_multiple", 1))
        vocab += -vocab % multiple
        # Dynamic NTK scaling (`rotary_scaling_factor`) changes the rotary base only beyond
        # `max_trained_positions`, by the padded length of the reference's batch: sequences are
        # kept within it, where the reference's rotary is the plain one.
        if hf.get("rotary_scaling_factor"):
            max_positions = int(hf.get("max_trained_positions", 2048))
        else:
            max_positions = int(hf.get("n_positions", 1024))
        return cls(
            vocab_size=vocab,
            hidden_size=hidden,
            num_layers=int(hf["n_layer"]),
            num_heads=heads,
            intermediate_size=int(inner),
            activation=act,
            max_positions=max_positions,
            type_vocab_size=int(hf.get("type_vocab_size", 2)),
            layer_norm_eps=float(hf.get("layer_norm_epsilon", 1e-5)),
            rotary_base=float(hf.get("rotary_emb_base", 10000.0)),
            qkv_bias=bool(hf.get("qkv_proj_bias", True)),
            fc1_bias=bool(hf.get("mlp_fc1_bias", True)),
            fc2_bias=bool(hf.get("mlp_fc2_bias", True)),
        )


class NomicBertEmbeddings(nn.Module):
    def __init__(self, c: NomicBertConfig):
        super().__init__()
        self.word_embeddings = nn.Embedding(c.vocab_size, c.hidden_size)
        self.token_type_embeddings: nn.Embedding | None = None
        if c.type_vocab_size > 0:
            self.token_type_embeddings = nn.Embedding(c.type_vocab_size, c.hidden_size)


class NomicBertAttention(nn.Module):
    def __init__(self, c: NomicBertConfig):
        super().__init__()
        self.num_heads = c.num_heads
        self.Wqkv = nn.Linear(c.hidden_size, 3 * c.hidden_size, bias=c.qkv_bias)
        self.out_proj = nn.Linear(c.hidden_size, c.hidden_size, bias=c.qkv_bias)

    def forward(
        self,
        x: torch.Tensor,  # [num_tokens, hidden]
        cos: torch.Tensor,  # [num_tokens, head_dim]
        sin: torch.Tensor,
        attn: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, hidden]
        out = packed_rotary_attention(self.Wqkv(x), cos, sin, attn, self.num_heads)
        return self.out_proj(out)


class NomicBertGatedMLP(nn.Module):
    """`fc2(fc11(x) * act(fc12(x)))`; fc11 and fc12 run as one matmul once fused."""

    def __init__(self, c: NomicBertConfig):
        super().__init__()
        self.fc11 = nn.Linear(c.hidden_size, c.intermediate_size, bias=c.fc1_bias)
        self.fc12 = nn.Linear(c.hidden_size, c.intermediate_size, bias=c.fc1_bias)
        self.fc2 = nn.Linear(c.intermediate_size, c.hidden_size, bias=c.fc2_bias)
        self.act = _GATES[c.activation]
        self.fc1: FusedProjections | None = None

    def fuse_projections(self) -> None:
        fuse(self, "fc1", ["fc11", "fc12"])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        assert self.fc1 is not None, "projections are fused when the weights load"
        y, gate = self.fc1(x)
        return self.fc2(y * self.act(gate))


class NomicBertBlock(nn.Module):
    """Post-norm: `norm1(attn(x) + x)`, then `norm2(mlp(x) + x)`."""

    def __init__(self, c: NomicBertConfig):
        super().__init__()
        self.attn = NomicBertAttention(c)
        self.mlp = NomicBertGatedMLP(c)
        self.norm1 = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps)
        self.norm2 = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: AttentionMetadata
    ) -> torch.Tensor:
        x = self.norm1(self.attn(x, cos, sin, attn) + x)
        return self.norm2(self.mlp(x) + x)


class NomicBertEncoder(nn.Module):
    def __init__(self, c: NomicBertConfig):
        super().__init__()
        self.layers = nn.ModuleList(NomicBertBlock(c) for _ in range(c.num_layers))


class NomicBertModel(EncoderModel):
    """`embeddings`, `emb_ln`, `encoder`: the checkpoint of nomic-embed-text."""

    checkpoint_prefixes = ("bert.",)
    unused_checkpoint_keys: ClassVar[tuple[str, ...]] = ("pooler.*",)

    def __init__(self, c: NomicBertConfig):
        super().__init__(c, c.max_positions, c.type_vocab_size)
        self.config = c
        self.rotary = Rotary(c.head_dim, {"rope_theta": c.rotary_base})
        self.embeddings = NomicBertEmbeddings(c)
        self.emb_ln = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps)
        self.encoder = NomicBertEncoder(c)

    @classmethod
    def from_hf_config(cls, hf: dict[str, Any]) -> PoolingModel:
        return cls(NomicBertConfig.from_hf(hf))

    @property
    def default_pooler(self) -> str:
        """Mean, as nomic-embed-text pools, when the folder does not say."""
        return "MEAN"

    def encode(
        self,
        inputs_embeds: torch.Tensor,
        positions: torch.Tensor,
        attn: AttentionMetadata,
        token_type_ids: torch.Tensor,
    ) -> torch.Tensor:
        x = inputs_embeds
        types = self.embeddings.token_type_embeddings
        if types is not None:
            x = x + types(token_type_ids)
        x = self.emb_ln(x)
        cos, sin = self.rotary.cos_sin(positions, x.dtype)
        for layer in self.encoder.layers:
            x = layer(x, cos, sin, attn)
        return x
