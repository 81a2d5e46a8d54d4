"""Qwen2: a pre-norm decoder with biases on the query, key and value projections.

gte-Qwen2 and stella embedders ship it with `is_causal: false`: their attention runs both ways
(`read_config` reads the flag), and they pool by their sentence-transformers folder.
"""

from __future__ import annotations

from typing import Any

from vecpool.models.decoder import (
    FULL_ATTENTION,
    SLIDING_ATTENTION,
    DecoderConfig,
    DecoderForCausalLM,
    DecoderForSequenceClassification,
    DecoderForTokenClassification,
    DecoderModel,
    read_config,
)

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
        # As Qwen3: sliding windows only with use_sliding_window, on the layers from
        # max_window_layers on (or as layer_types says).
        window = hf.get("sliding_window", 4096) if hf.get("use_sliding_window") else None
        layer_types = hf.get("layer_types")
        if layer_types is None:
            first_sliding = int(hf.get("max_window_layers", 28))
            layer_types = [
                SLIDING_ATTENTION if window is not None and i >= first_sliding else FULL_ATTENTION
                for i in range(int(hf.get("num_hidden_layers") or 0))
            ]
        return read_config(
            hf,
            defaults=_DEFAULTS,
            layer_types=layer_types,
            sliding_window=None if window is None else int(window),
            qkv_bias=True,
        )


class Qwen2ForCausalLM(DecoderForCausalLM, Qwen2Model):
    """Qwen2 with its language-model head (gte-Qwen2 ships its base tensors under it)."""


class Qwen2ForSequenceClassification(DecoderForSequenceClassification, Qwen2Model):
    """Qwen2 scoring its last token with `score` (reward models, rerankers)."""


class Qwen2ForTokenClassification(DecoderForTokenClassification, Qwen2Model):
    """Qwen2 with `score` on every token row."""
