"""What the decoder architectures share: config reading, attention, the pre-norm layer, the model.

Qwen3, Llama/Mistral and Gemma2 differ in a handful of options (q/k norms, biases, sliding
windows, soft-capping, sandwich norms, embedding scale); each architecture file reads its
`config.json` into a `DecoderConfig` and, where its layer differs, subclasses `DecoderLayer`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache
from typing import Any, ClassVar, Protocol, cast

import torch
import torch.nn.functional as F
from torch import nn

from vecpool.errors import ConfigError
from vecpool.models.base import Capability, PoolingModel, hf_num_labels
from vecpool.models.hf import CHECKPOINT_QUANT_METHODS, hf_get
from vecpool.models.layers import qk_rotary
from vecpool.models.layers.attention import AttentionMetadata, flat_attention
from vecpool.models.layers.basic import (
    FusedProjections,
    GatedMLP,
    RMSNorm,
    Rotary,
    add_linear,
    apply_rotary,
    fuse,
)

FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"
# Hugging Face's defaults for keys a config.json may leave out: LlamaConfig's, MistralConfig's,
# Qwen2Config's (Qwen3Config's with head_dim 128), and GemmaConfig's (Gemma2's and Gemma3's).
LLAMA_DEFAULTS: dict[str, Any] = {
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
}
GEMMA_DEFAULTS: dict[str, Any] = {
    "head_dim": 256,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
}
# One rotary embedding for every layer, or one per layer.
LayerRotary = Rotary | Sequence[Rotary]


@dataclass(frozen=True)
class DecoderConfig:
    """A decoder's shape and options, read once from its Hugging Face config."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_act: str
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    is_causal: bool
    # Per layer, the `window` given to `flat_attention` (None: the whole sequence).
    layer_windows: tuple[int | None, ...]
    attention_bias: bool = False  # on q/k/v/o projections
    qkv_bias: bool = False  # on q/k/v only, o_proj without (Qwen2)
    mlp_bias: bool = False
    qk_norm: bool = False  # RMSNorm over head_dim on q and k, before rotary (Qwen3)
    attn_scale: float | None = None  # None: head_dim ** -0.5
    attn_softcap: float | None = None  # tanh soft-capping of attention logits (Gemma2)
    final_softcap: float | None = None  # tanh soft-capping of lm_head logits (Gemma2)
    norm_unit_offset: bool = False  # norms scale by (1 + weight) (Gemma)
    embed_scale: float | None = None  # inputs are multiplied by this (Gemma: sqrt(hidden_size))
    num_labels: int = 2  # outputs of a classification head

    def __post_init__(self) -> None:
        if self.num_kv_heads < 1 or self.num_heads % self.num_kv_heads != 0:
            raise ConfigError(
                f"num_attention_heads={self.num_heads} is not a multiple of "
                f"num_key_value_heads={self.num_kv_heads}"
            )

    @property
    def num_layers(self) -> int:
        return len(self.layer_windows)

    @property
    def scale(self) -> float:
        return self.attn_scale if self.attn_scale is not None else self.head_dim**-0.5


def read_config(
    hf: dict[str, Any],
    *,
    defaults: dict[str, Any],
    layer_types: Sequence[str] | None,
    sliding_window: int | None,
    **options: Any,
) -> DecoderConfig:
    """The fields every decoder shares, from `hf`; `defaults` are the architecture's own
    Hugging Face defaults for keys a config.json may leave out; `options` set (or override)
    the rest."""
    check_supported(hf)

    def get(key: str) -> Any:
        value = hf_get(hf, key, default=defaults.get(key))
        if value is None:
            raise ConfigError(f"config.json has no {key!r}")
        return value

    num_heads = int(get("num_attention_heads"))
    hidden_size = int(get("hidden_size"))
    num_layers = int(get("num_hidden_layers"))
    causal = not is_bidirectional(hf)
    if layer_types is None:
        layer_types = [FULL_ATTENTION] * num_layers
    if len(layer_types) != num_layers:
        raise ConfigError(
            f"layer_types has {len(layer_types)} entries for num_hidden_layers={num_layers}"
        )
    fields: dict[str, Any] = dict(
        vocab_size=int(get("vocab_size")),
        hidden_size=hidden_size,
        intermediate_size=int(get("intermediate_size")),
        num_heads=num_heads,
        num_kv_heads=int(hf_get(hf, "num_key_value_heads", default=num_heads)),
        head_dim=int(hf_get(hf, "head_dim", default=defaults.get("head_dim", 0)))
        or hidden_size // num_heads,
        hidden_act=str(options.pop("hidden_act", None) or get("hidden_act")),
        rms_norm_eps=float(get("rms_norm_eps")),
        max_position_embeddings=int(get("max_position_embeddings")),
        tie_word_embeddings=bool(get("tie_word_embeddings")),
        is_causal=causal,
        layer_windows=layer_windows(layer_types, sliding_window, causal),
        num_labels=hf_num_labels(hf),
    )
    return DecoderConfig(**{**fields, **options})


def check_supported(hf: dict[str, Any]) -> None:
    """Raise `ConfigError` naming a config feature the decoders do not implement."""
    if hf.get("quantization_config"):
        method = hf["quantization_config"].get("quant_method", "unknown")
        if method not in CHECKPOINT_QUANT_METHODS:  # the loader reads those methods' tensors
            raise ConfigError(
                f"quantized checkpoints (quantization_config: {method}) are not supported "
                f"(supported: {', '.join(CHECKPOINT_QUANT_METHODS)} in FP8)"
            )
    if hf.get("is_causal") is True and hf.get("use_bidirectional_attention") is True:
        raise ConfigError(
            "config.json sets both is_causal=true and use_bidirectional_attention=true"
        )


def is_bidirectional(hf: dict[str, Any]) -> bool:
    """Whether the config turns the decoder's attention non-causal (embedding fine-tunes)."""
    return hf.get("is_causal") is False or hf.get("use_bidirectional_attention") is True


def layer_windows(
    layer_types: Sequence[str], sliding_window: int | None, causal: bool
) -> tuple[int | None, ...]:
    """Each layer's `flat_attention` window. Causal: query i sees keys j with i - j < W, as
    Hugging Face's sliding-window mask; bidirectional: |i - j| <= W, as Hugging Face's
    bidirectional sliding-window mask, which is a window of W + 1 in `flat_attention`'s terms."""
    unknown = sorted(set(layer_types) - {FULL_ATTENTION, SLIDING_ATTENTION})
    if unknown:
        raise ConfigError(
            f"layer_types {unknown} are not supported ({FULL_ATTENTION}, {SLIDING_ATTENTION})"
        )
    if sliding_window is not None and sliding_window < 1:
        raise ConfigError(f"sliding_window must be positive, got {sliding_window}")
    window = None if sliding_window is None else sliding_window + (0 if causal else 1)
    return tuple(window if t == SLIDING_ATTENTION else None for t in layer_types)


class DecoderAttention(nn.Module):
    """Grouped-query self-attention with rotary positions, over a flat batch."""

    def __init__(self, c: DecoderConfig, window: int | None):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_heads, c.num_kv_heads, c.head_dim
        self.causal = c.is_causal
        self.scale = c.scale
        self.window = window
        self.softcap = c.attn_softcap
        q_size, kv_size = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        qkv_bias = c.attention_bias or c.qkv_bias
        self.q_proj = nn.Linear(c.hidden_size, q_size, bias=qkv_bias)
        self.k_proj = nn.Linear(c.hidden_size, kv_size, bias=qkv_bias)
        self.v_proj = nn.Linear(c.hidden_size, kv_size, bias=qkv_bias)
        self.o_proj = nn.Linear(q_size, c.hidden_size, bias=c.attention_bias)
        self.q_norm: RMSNorm | None = None
        self.k_norm: RMSNorm | None = None
        if c.qk_norm:
            self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps, c.norm_unit_offset)
            self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps, c.norm_unit_offset)
        self.qkv_proj: FusedProjections | None = None
        # The query / key norms and rotary positions through `qk_rotary`'s kernel where it
        # serves (CUDA, models with those norms) in steps that attend through the packed
        # kernel; False keeps the modules (a benchmark's baseline).
        self.one_kernel_rotary = True

    def fuse_projections(self) -> None:
        fuse(self, "qkv_proj", ["q_proj", "k_proj", "v_proj"])

    def forward(
        self,
        x: torch.Tensor,  # [num_tokens, hidden]
        cos: torch.Tensor,  # [num_tokens, head_dim]
        sin: torch.Tensor,  # [num_tokens, head_dim]
        attn: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, hidden]
        return self.o_proj(self.attend(x, cos, sin, attn))

    def add_to(
        self,
        residual: torch.Tensor,  # [num_tokens, hidden], may be overwritten (`add_linear`)
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attn: AttentionMetadata,
    ) -> torch.Tensor:
        """`residual + self(x, ...)`."""
        return add_linear(residual, self.o_proj, self.attend(x, cos, sin, attn))

    def attend(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: AttentionMetadata
    ) -> torch.Tensor:  # [num_tokens, heads * head_dim], before the output projection
        assert self.qkv_proj is not None, "projections are fused when the weights load"
        return self.attend_projected(self.qkv_proj(x), cos, sin, attn)

    def attend_projected(
        self,
        qkv: tuple[torch.Tensor, ...],  # q [n, heads * head_dim], k and v [n, kv_heads * head_dim]
        cos: torch.Tensor,
        sin: torch.Tensor,
        attn: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, heads * head_dim], before the output projection
        q, k, v = qkv
        n = q.shape[0]
        q = q.view(n, self.num_heads, self.head_dim)
        k = k.view(n, self.num_kv_heads, self.head_dim)
        v = v.view(n, self.num_kv_heads, self.head_dim)
        q_norm, k_norm = self.q_norm, self.k_norm
        if q_norm is None or k_norm is None:
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        elif self.one_kernel_rotary and attn.packed and qk_rotary.serves(q, k, cos, sin):
            q, k = qk_rotary.qk_norm_rotary(
                q, k, cos, sin, q_norm.weight, k_norm.weight, q_norm.eps, q_norm.unit_offset
            )
        else:
            q, k = apply_rotary(q_norm(q), cos, sin), apply_rotary(k_norm(k), cos, sin)
        out = flat_attention(
            q,
            k,
            v,
            attn,
            causal=self.causal,
            scale=self.scale,
            window=self.window,
            softcap=self.softcap,
        )
        return out.reshape(n, -1)


class DecoderLayer(nn.Module):
    """Pre-norm block: `x + attn(norm(x))`, then `x + mlp(norm(x))` (Llama, Mistral, Qwen3)."""

    def __init__(self, c: DecoderConfig, window: int | None):
        super().__init__()
        self.self_attn = DecoderAttention(c, window)
        self.mlp = GatedMLP(c.hidden_size, c.intermediate_size, c.hidden_act, bias=c.mlp_bias)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, c.norm_unit_offset)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, c.norm_unit_offset)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: AttentionMetadata
    ) -> torch.Tensor:
        # Both residual sums overwrite their residual on CUDA when compiled (`add_linear`): the
        # layer's input is the layer before's output, or the step's fresh embedding lookup.
        x = self.self_attn.add_to(x, self.input_layernorm(x), cos, sin, attn)
        return self.mlp.add_to(x, self.post_attention_layernorm(x))


class NormFoldedProjection(Protocol):
    """A projection of its input's RMSNorm with the norm inside it (`quant.linear.Fp8NormLinear`)."""

    def __call__(self, x: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, ...]: ...

    def add_forward(
        self, residual: torch.Tensor, delta: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | tuple[torch.Tensor, ...]]:
        """(`residual + delta`, this projection of the sum's norm)."""
        ...


class NormFoldedMLP(Protocol):
    """A gated MLP whose norm is folded into `gate_up_proj` (`quant.linear.Fp8GatedMLP`)."""

    gate_up_proj: NormFoldedProjection

    def down(self, gate_up: torch.Tensor) -> torch.Tensor:
        """The MLP's output from its gate | up projection."""
        ...


class SumInNormLayer(DecoderLayer):
    """A pre-norm layer whose norms are folded into the projections they feed (FP8 models:
    `quant.linear.finish_fp8` turns a stack of `DecoderLayer`s into these), each residual sum
    added by the norm that reads it: the residual stream goes from layer to layer as a pair
    (the sum so far, what to add to it), so no layer writes a sum only for the next to read it
    back. The first layer takes the embeddings as they are; the last adds its own sum
    (`hands_on_sum` False) for the final norm. On CUDA this saves a kernel and a pass over the
    rows per sum; elsewhere the sums are the same additions in another place."""

    hands_on_sum = True  # False in the last layer

    def forward(  # type: ignore[override]
        self,
        x: torch.Tensor | tuple[torch.Tensor, torch.Tensor],  # [n, hidden], or two of them
        cos: torch.Tensor,
        sin: torch.Tensor,
        attn: AttentionMetadata,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        self_attn = self.self_attn
        qkv_proj = cast(NormFoldedProjection, self_attn.qkv_proj)
        mlp = cast(NormFoldedMLP, self.mlp)
        if isinstance(x, tuple):
            residual, qkv = qkv_proj.add_forward(*x)
        else:
            residual, qkv = x, qkv_proj(x)
        assert isinstance(qkv, tuple)  # q, k, v
        out = self_attn.o_proj(self_attn.attend_projected(qkv, cos, sin, attn))
        residual, gate_up = mlp.gate_up_proj.add_forward(residual, out)
        assert isinstance(gate_up, torch.Tensor)  # gate | up, one tensor
        delta = mlp.down(gate_up)
        return (residual, delta) if self.hands_on_sum else residual + delta


class DecoderModel(PoolingModel):
    """`embed_tokens`, `layers`, `norm`: the base model of a decoder checkpoint.

    Also serves checkpoints saved from the `*ForCausalLM` class (`model.` prefix). `rotary` is
    one rotary embedding for every layer, or one per layer (Gemma3: one base for sliding layers,
    another for global ones); each distinct one computes its cos/sin once per forward.
    """

    checkpoint_prefixes = ("model.",)
    unused_checkpoint_keys: ClassVar[tuple[str, ...]] = ("*.rotary_emb.inv_freq",)
    layer_class: ClassVar[type[DecoderLayer]] = DecoderLayer
    # Hugging Face's defaults for the keys the architecture's config.json may leave out.
    hf_defaults: ClassVar[dict[str, Any]] = LLAMA_DEFAULTS

    def __init__(self, c: DecoderConfig, rotary: LayerRotary):
        super().__init__()
        self.config = c
        self.hidden_size = c.hidden_size
        self.vocab_size = c.vocab_size
        self.max_positions = c.max_position_embeddings
        self.is_causal = c.is_causal
        per_layer = [rotary] * c.num_layers if isinstance(rotary, Rotary) else list(rotary)
        if len(per_layer) != c.num_layers:
            raise ConfigError(f"{len(per_layer)} rotary embeddings for {c.num_layers} layers")
        # The distinct rotary embeddings, and which one each layer uses.
        self.rotaries: list[Rotary] = list({id(r): r for r in per_layer}.values())
        self.layer_rotary = tuple(
            next(i for i, r in enumerate(self.rotaries) if r is layer) for layer in per_layer
        )
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(self.layer_class(c, w) for w in c.layer_windows)
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps, c.norm_unit_offset)

    @classmethod
    def from_hf_config(cls, hf: dict[str, Any]) -> PoolingModel:
        c = cls.config_from_hf(hf)
        return cls(c, Rotary(c.head_dim, hf))

    @classmethod
    def config_from_hf(cls, hf: dict[str, Any]) -> DecoderConfig:
        """The architecture's reading of its config.json."""
        raise NotImplementedError

    @classmethod
    def read_config(
        cls,
        hf: dict[str, Any],
        *,
        layer_types: Sequence[str] | None = None,
        sliding_window: int | None = None,
        **options: Any,
    ) -> DecoderConfig:
        """`read_config` under the class's `hf_defaults`; no sliding windows unless given."""
        return read_config(
            hf,
            defaults=cls.hf_defaults,
            layer_types=layer_types,
            sliding_window=sliding_window,
            **options,
        )

    @property
    def default_pooler(self) -> str:
        return "LAST" if self.is_causal else "MEAN"

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        if self.config.embed_scale is not None:  # Gemma: scaled in the lookup, as in transformers
            x = x * _in_dtype(self.config.embed_scale, x.dtype)
        return x

    def forward(
        self,
        inputs_embeds: torch.Tensor,
        positions: torch.Tensor,
        attn: AttentionMetadata,
        token_type_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        x = inputs_embeds
        tables = [r.cos_sin(positions, x.dtype) for r in self.rotaries]  # [num_tokens, head_dim]
        for layer, r in zip(self.layers, self.layer_rotary, strict=True):
            cos, sin = tables[r]
            x = layer(x, cos, sin, attn)
        return self.norm(x)


class DecoderForCausalLM(DecoderModel):
    """The base model's parameters plus `lm_head`, from a `*ForCausalLM` checkpoint.

    The base parameters sit at the top level (not under `model.`) so that both checkpoint
    layouts load: `model.`-prefixed ones, and embedding models that store the base model's
    names under a `*ForCausalLM` architecture. With `tie_word_embeddings`, `lm_head` is the
    embedding table unless the checkpoint stores a different one, as in transformers.
    """

    tied_weights: ClassVar[dict[str, str]] = {"lm_head.weight": "embed_tokens.weight"}
    # Embedding checkpoints in the base model's layout (Qwen3-Embedding-8B) name this class
    # but ship no head.
    optional_parameters = ("lm_head.weight",)
    capabilities = frozenset({Capability.CAUSAL_LM})

    def __init__(self, c: DecoderConfig, rotary: LayerRotary):
        super().__init__(c, rotary)
        self.tie_word_embeddings = c.tie_word_embeddings
        self.lm_head: nn.Linear | None = nn.Linear(c.hidden_size, c.vocab_size, bias=False)

    def drop_parameter(self, name: str) -> None:
        if name == "lm_head.weight":
            self.lm_head = None
            self.capabilities = frozenset()

    def compute_logits(
        self, rows: torch.Tensor, vocab_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        """`[num_tokens, hidden]` final hidden states -> `[num_tokens, vocab]` logits (or only
        the `vocab_ids` columns: a reranker reads two)."""
        if self.lm_head is None:
            raise ConfigError(
                "this checkpoint has no lm_head.weight (and does not tie it), so it cannot "
                "produce vocabulary logits"
            )
        weight = self.lm_head.weight
        if vocab_ids is not None:
            weight = weight[vocab_ids]
        logits = F.linear(rows, weight)
        cap = self.config.final_softcap
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits


class DecoderForSequenceClassification(DecoderModel):
    """The last token's row through `score` (no bias), as transformers' generic class: reward
    models and decoder cross-encoders."""

    capabilities = frozenset({Capability.SEQUENCE_CLASSIFIER})
    classifier_pooler = "LAST"

    def __init__(self, c: DecoderConfig, rotary: LayerRotary):
        super().__init__(c, rotary)
        self.num_labels = c.num_labels
        self.score = nn.Linear(c.hidden_size, c.num_labels, bias=False)

    def classify(self, pooled: torch.Tensor) -> torch.Tensor:
        return self.score(pooled)


class DecoderForTokenClassification(DecoderModel):
    """`score` (with a bias) on every token row, as transformers' generic class."""

    capabilities = frozenset({Capability.TOKEN_CLASSIFIER})

    def __init__(self, c: DecoderConfig, rotary: LayerRotary):
        super().__init__(c, rotary)
        self.num_labels = c.num_labels
        self.score = nn.Linear(c.hidden_size, c.num_labels)

    def classify_tokens(self, rows: torch.Tensor) -> torch.Tensor:
        return self.score(rows)


@cache
def _in_dtype(value: float, dtype: torch.dtype) -> float:
    """`value` rounded through float32 to `dtype`, as Hugging Face casts its scale tensors."""
    return float(torch.tensor(value, dtype=torch.float32).to(dtype))


DecoderHeads = tuple[
    type[DecoderForCausalLM],
    type[DecoderForSequenceClassification],
    type[DecoderForTokenClassification],
]


def decoder_heads(base: type[DecoderModel], family: str | None = None) -> DecoderHeads:
    """`{family}ForCausalLM`, `{family}ForSequenceClassification` and
    `{family}ForTokenClassification`: `base` under each of the three heads, as transformers
    names them (`family`: the base's class name less "Model" unless given). Each is a class of
    `base`'s module, for the registry to find by name."""
    family = family or base.__name__.removesuffix("Model")
    heads: list[type[DecoderModel]] = []
    for head, doc in (
        (DecoderForCausalLM, "{} with its language-model head."),
        (DecoderForSequenceClassification, "{} scoring its last token with `score`."),
        (DecoderForTokenClassification, "{} with `score` on every token row."),
    ):
        name = family + head.__name__.removeprefix("Decoder")
        attrs = {"__doc__": doc.format(family), "__module__": base.__module__, "__qualname__": name}
        heads.append(type(name, (head, base), attrs))
    return cast(DecoderHeads, tuple(heads))
