"""ModernBERT: a pre-norm encoder with rotary positions, alternating global and local attention.

Global layers attend to the whole sequence; local (sliding-window) layers to the tokens at most
`local_attention / 2` positions away on either side. Each kind has its own rotary theta. The MLP
is GeGLU (`Wi` holds the input and gate halves). Unpadded by design, it runs on flat batches as
they are, through the varlen kernel on CUDA. Besides the base model: the masked-LM head, the
sequence classifier (CLS row or mean of the rows, `classifier_pooling`) and the token classifier,
each behind the shared `head` (dense, activation, norm).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from vecpool.errors import ConfigError
from vecpool.models.architectures.encoder import EncoderModel
from vecpool.models.base import Capability, PoolingModel, hf_num_labels
from vecpool.models.layers.attention import AttentionMetadata
from vecpool.models.layers.basic import Rotary, activation
from vecpool.models.layers.encoder_blocks import PackedRotaryAttention

FULL, SLIDING = "full_attention", "sliding_attention"
# transformers' ModernBertConfig defaults, for keys a config.json leaves out.
_DEFAULT_THETA = {FULL: 160_000.0, SLIDING: 10_000.0}


@dataclass(frozen=True)
class ModernBertConfig:
    vocab_size: int
    hidden_size: int
    num_heads: int
    intermediate_size: int
    hidden_act: str
    max_position_embeddings: int
    norm_eps: float
    norm_bias: bool
    attention_bias: bool
    mlp_bias: bool
    layer_types: tuple[str, ...]  # per layer: FULL or SLIDING
    rope_theta: dict[str, float]  # per layer type
    window: int  # `flat_attention` window of local layers: |i - j| <= local_attention // 2
    classifier_pooling: str  # "CLS" or "MEAN"
    classifier_bias: bool
    classifier_act: str
    decoder_bias: bool
    tie_word_embeddings: bool
    num_labels: int

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> ModernBertConfig:
        num_layers = int(hf["num_hidden_layers"])
        layer_types = hf.get("layer_types")
        if layer_types is None:  # the older form: every n-th layer global, from the first
            every = int(hf.get("global_attn_every_n_layers", 3))
            layer_types = [SLIDING if i % every else FULL for i in range(num_layers)]
        unknown = sorted(set(layer_types) - {FULL, SLIDING})
        if unknown or len(layer_types) != num_layers:
            raise ConfigError(
                f"layer_types must name {num_layers} layers, each {FULL!r} or {SLIDING!r}; "
                f"got {layer_types}"
            )
        rope_parameters = hf.get("rope_parameters") or {}
        old_keys = {FULL: "global_rope_theta", SLIDING: "local_rope_theta"}
        theta: dict[str, float] = {}
        for kind in (FULL, SLIDING):
            params = rope_parameters.get(kind) or {}
            rope_type = params.get("rope_type", "default")
            if rope_type != "default":
                raise ConfigError(f"ModernBERT rope_type {rope_type!r} is not supported (default)")
            theta[kind] = float(
                params.get("rope_theta", hf.get(old_keys[kind], _DEFAULT_THETA[kind]))
            )
        pooling = str(hf.get("classifier_pooling", "cls")).upper()
        if pooling not in ("CLS", "MEAN"):
            raise ConfigError(
                f"classifier_pooling {pooling.lower()!r} is not supported (cls, mean)"
            )
        hidden, heads = int(hf["hidden_size"]), int(hf["num_attention_heads"])
        if hidden % heads:
            raise ConfigError(
                f"hidden_size={hidden} is not a multiple of num_attention_heads={heads}"
            )
        return cls(
            vocab_size=int(hf["vocab_size"]),
            hidden_size=hidden,
            num_heads=heads,
            intermediate_size=int(hf["intermediate_size"]),
            hidden_act=str(hf.get("hidden_activation", "gelu")),
            max_position_embeddings=int(hf.get("max_position_embeddings", 8192)),
            norm_eps=float(hf.get("norm_eps", 1e-5)),
            norm_bias=bool(hf.get("norm_bias", False)),
            attention_bias=bool(hf.get("attention_bias", False)),
            mlp_bias=bool(hf.get("mlp_bias", False)),
            layer_types=tuple(layer_types),
            rope_theta=theta,
            window=int(hf.get("local_attention", 128)) // 2 + 1,
            classifier_pooling=pooling,
            classifier_bias=bool(hf.get("classifier_bias", False)),
            classifier_act=str(hf.get("classifier_activation", "gelu")),
            decoder_bias=bool(hf.get("decoder_bias", True)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", True)),
            num_labels=hf_num_labels(hf),
        )


def _norm(c: ModernBertConfig) -> nn.LayerNorm:
    return nn.LayerNorm(c.hidden_size, eps=c.norm_eps, bias=c.norm_bias)


class ModernBertEmbeddings(nn.Module):
    def __init__(self, c: ModernBertConfig):
        super().__init__()
        self.tok_embeddings = nn.Embedding(c.vocab_size, c.hidden_size)
        self.norm = _norm(c)


class ModernBertMLP(nn.Module):
    """GeGLU: `Wo(act(input) * gate)`, input and gate the two halves of `Wi(x)`."""

    def __init__(self, c: ModernBertConfig):
        super().__init__()
        self.Wi = nn.Linear(c.hidden_size, 2 * c.intermediate_size, bias=c.mlp_bias)
        self.Wo = nn.Linear(c.intermediate_size, c.hidden_size, bias=c.mlp_bias)
        self.act = activation(c.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        inputs, gate = self.Wi(x).chunk(2, dim=-1)
        return self.Wo(self.act(inputs) * gate)


class ModernBertEncoderLayer(nn.Module):
    """Pre-norm block; the first layer has no attention norm (the embeddings' norm serves).
    It reads the cos and sin of its layer type's rotary table, number `table` of the step's."""

    def __init__(self, c: ModernBertConfig, index: int, table: int):
        super().__init__()
        self.table = table
        self.attn_norm: nn.Module = nn.Identity() if index == 0 else _norm(c)
        # Self-attention through the fused `Wqkv`, rotary on queries and keys, global or windowed.
        window = c.window if c.layer_types[index] == SLIDING else None
        biases = (c.attention_bias, c.attention_bias)
        self.attn = PackedRotaryAttention(
            c.hidden_size, c.num_heads, ("Wqkv", "Wo"), biases, window
        )
        self.mlp_norm = _norm(c)
        self.mlp = ModernBertMLP(c)

    def forward(
        self, x: torch.Tensor, attn: AttentionMetadata, *tables: torch.Tensor
    ) -> torch.Tensor:  # tables: cos, sin of each rotary table, [num_tokens, head_dim]
        cos, sin = tables[2 * self.table], tables[2 * self.table + 1]
        x = x + self.attn(self.attn_norm(x), cos, sin, attn)
        return x + self.mlp(self.mlp_norm(x))


class ModernBertModel(EncoderModel):
    """`embeddings`, `layers`, `final_norm`: the base model of any ModernBERT checkpoint."""

    checkpoint_prefixes = ("model.",)
    embeddings: ModernBertEmbeddings

    def __init__(self, c: ModernBertConfig):
        super().__init__(c, c.max_position_embeddings)
        self.config = c
        self.embeddings = ModernBertEmbeddings(c)
        # One rotary table per layer type in use, each from its own theta.
        kinds = list(dict.fromkeys(c.layer_types))
        self.rotary = [Rotary(c.head_dim, {"rope_theta": c.rope_theta[kind]}) for kind in kinds]
        self.layers = nn.ModuleList(
            ModernBertEncoderLayer(c, i, kinds.index(kind)) for i, kind in enumerate(c.layer_types)
        )
        self.final_norm = _norm(c)

    @classmethod
    def from_hf_config(cls, hf: dict[str, Any]) -> PoolingModel:
        return cls(ModernBertConfig.from_hf(hf))

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embeddings.tok_embeddings(input_ids)

    def embed(
        self, inputs_embeds: torch.Tensor, positions: torch.Tensor, types: torch.Tensor | None
    ) -> torch.Tensor:
        return self.embeddings.norm(inputs_embeds)

    def layer_stack(self) -> nn.ModuleList:
        return self.layers

    def layer_inputs(
        self, x: torch.Tensor, positions: torch.Tensor, attn: AttentionMetadata
    ) -> tuple[torch.Tensor, ...]:
        return tuple(t for rotary in self.rotary for t in rotary.cos_sin(positions, x.dtype))

    def final(self, x: torch.Tensor) -> torch.Tensor:
        return self.final_norm(x)


class ModernBertPredictionHead(nn.Module):
    """dense, activation, norm: shared by the masked-LM and classification heads."""

    def __init__(self, c: ModernBertConfig):
        super().__init__()
        self.dense = nn.Linear(c.hidden_size, c.hidden_size, bias=c.classifier_bias)
        self.act = activation(c.classifier_act)
        self.norm = _norm(c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.act(self.dense(x)))


class ModernBertForMaskedLM(ModernBertModel):
    """`head` then `decoder` (tied to the token embeddings) on token rows (SPLADE)."""

    tied_weights: ClassVar[dict[str, str]] = {"decoder.weight": "embeddings.tok_embeddings.weight"}
    capabilities = frozenset({Capability.MASKED_LM})

    def __init__(self, c: ModernBertConfig):
        super().__init__(c)
        self.tie_word_embeddings = c.tie_word_embeddings
        self.head = ModernBertPredictionHead(c)
        self.decoder = nn.Linear(c.hidden_size, c.vocab_size, bias=c.decoder_bias)

    def compute_logits(
        self, rows: torch.Tensor, vocab_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        weight: torch.Tensor = self.decoder.weight
        bias: torch.Tensor | None = self.decoder.bias
        if vocab_ids is not None:
            weight = weight[vocab_ids]
            bias = None if bias is None else bias[vocab_ids]
        return F.linear(self.head(rows), weight, bias)


class ModernBertForSequenceClassification(ModernBertModel):
    """The CLS row or the mean of the rows (`classifier_pooling`), `head`, `classifier`."""

    capabilities = frozenset({Capability.SEQUENCE_CLASSIFIER})

    def __init__(self, c: ModernBertConfig):
        super().__init__(c)
        self.num_labels = c.num_labels
        self.classifier_pooler = c.classifier_pooling
        self.head = ModernBertPredictionHead(c)
        self.classifier = nn.Linear(c.hidden_size, c.num_labels)

    def classify(self, pooled: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.head(pooled))


class ModernBertForTokenClassification(ModernBertModel):
    """`head` then `classifier` on every token row."""

    capabilities = frozenset({Capability.TOKEN_CLASSIFIER})

    def __init__(self, c: ModernBertConfig):
        super().__init__(c)
        self.num_labels = c.num_labels
        self.head = ModernBertPredictionHead(c)
        self.classifier = nn.Linear(c.hidden_size, c.num_labels)

    def classify_tokens(self, rows: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.head(rows))
