"""GTE "new" (Alibaba-NLP's `NewModel`, `model_type: new`): gte-base-en-v1.5, gte-large-en-v1.5,
gte-multilingual-base and its reranker.

The rotary post-norm encoder of `rotary_bert`, under GTE's names, with NTK-scaled rotary
positions where `rope_scaling` says ("ntk"): a packed `qkv_proj` with biases, and the MLP's
`up_gate_proj` (the up and gate halves, no bias) and `down_proj`. Token types are added where
`type_vocab_size > 0`. The checkpoint's `unpad_inputs` only chooses how the reference pads;
flat batches are unpadded anyway. The published code lives in the model repositories (remote
code); this is written from it and never runs it.
"""

from __future__ import annotations

from typing import Any, ClassVar

from vecpool.errors import ConfigError
from vecpool.models.architectures.encoder_heads import PooledSequenceClassifier
from vecpool.models.architectures.rotary_bert import (
    RotaryBertConfig,
    RotaryBertModel,
    RotaryBertNames,
    check_settings,
)
from vecpool.models.base import hf_num_labels


def gte_config(hf: dict[str, Any]) -> RotaryBertConfig:
    """The encoder's shape and options from a GTE config.json."""
    check_settings(
        "GTE",
        {
            "position_embedding_type": (hf.get("position_embedding_type", "rope"), "rope"),
            "layer_norm_type": (hf.get("layer_norm_type", "layer_norm"), "layer_norm"),
            "pack_qkv": (hf.get("pack_qkv", True), True),
            "logn_attention_scale": (hf.get("logn_attention_scale", False), False),
        },
    )
    factor = mixed_b = None
    scaling = hf.get("rope_scaling")
    if scaling:
        kind = scaling.get("type", scaling.get("rope_type"))
        if kind != "ntk":
            raise ConfigError(f"GTE rope_scaling type {kind!r} is not supported (ntk)")
        factor = float(scaling["factor"])
        mixed_b = None if scaling.get("mixed_b") is None else float(scaling["mixed_b"])
    hidden, heads = int(hf["hidden_size"]), int(hf["num_attention_heads"])
    if hidden % heads:
        raise ConfigError(f"hidden_size={hidden} is not a multiple of num_attention_heads={heads}")
    return RotaryBertConfig(
        vocab_size=int(hf["vocab_size"]),
        hidden_size=hidden,
        num_layers=int(hf["num_hidden_layers"]),
        num_heads=heads,
        intermediate_size=int(hf["intermediate_size"]),
        gate_act=str(hf.get("hidden_act", "gelu")),
        max_positions=int(hf.get("max_position_embeddings", 512)),
        type_vocab_size=int(hf.get("type_vocab_size", 0)),
        layer_norm_eps=float(hf.get("layer_norm_eps", 1e-12)),
        rope_theta=float(hf.get("rope_theta", 10000.0)),
        num_labels=hf_num_labels(hf),
        ntk_factor=factor,
        ntk_mixed_b=mixed_b,
        up_gate_bias=False,
    )


class NewModel(RotaryBertModel):
    """`embeddings`, `encoder`: the base model of a GTE "new" checkpoint."""

    names = RotaryBertNames(
        embedding_norm="embeddings.LayerNorm",
        layers="encoder.layer",
        attention="attention",
        attention_norm="attn_ln",
        mlp_norm="mlp_ln",
        qkv="qkv_proj",
        out="o_proj",
        up_gate=("up_gate_proj",),
        down="down_proj",
    )
    checkpoint_prefixes = ("new.",)
    unused_checkpoint_keys: ClassVar[tuple[str, ...]] = ("pooler.*", "embeddings.position_ids")

    @classmethod
    def config_from_hf(cls, hf: dict[str, Any]) -> RotaryBertConfig:
        return gte_config(hf)


class NewForSequenceClassification(PooledSequenceClassifier, NewModel):
    """The CLS row through `pooler` (dense, tanh), then `classifier` (gte-multilingual-reranker)."""

    unused_checkpoint_keys: ClassVar[tuple[str, ...]] = ("embeddings.position_ids",)
