"""Qwen2: a pre-norm decoder with biases on the query, key and value projections.

gte-Qwen2 and stella embedders ship it with `is_causal: false`: their attention runs both ways
(`read_config` reads the flag), and they pool by their sentence-transformers folder.
"""

from __future__ import annotations

from typing import Any

from vecpool.models.architectures.decoder import (
    DecoderConfig,
    DecoderForCausalLM,
    DecoderForSequenceClassification,
    DecoderForTokenClassification,
    DecoderModel,
    read_config,
)
from vecpool.models.architectures.qwen3 import qwen_sliding_layers

# Hugging Face's Qwen2Config defaults, for keys a config.json leaves out.
_DEFAULTS: dict[str, Any] = {
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
}


class Qwen2Model(DecoderModel):
    """The Qwen2 base model (q/k/v biases, no o_proj bias)."""

    @classmethod
    def config_from_hf(cls, hf: dict[str, Any]) -> DecoderConfig:
        layer_types, window = qwen_sliding_layers(hf)  # as Qwen3
        return read_config(
            hf,
            defaults=_DEFAULTS,
            layer_types=layer_types,
            sliding_window=window,
            qkv_bias=True,
        )


class Qwen2ForCausalLM(DecoderForCausalLM, Qwen2Model):
    """Qwen2 with its language-model head (gte-Qwen2 ships its base tensors under it)."""


class Qwen2ForSequenceClassification(DecoderForSequenceClassification, Qwen2Model):
    """Qwen2 scoring its last token with `score` (reward models, rerankers)."""


class Qwen2ForTokenClassification(DecoderForTokenClassification, Qwen2Model):
    """Qwen2 with `score` on every token row."""
