"""Llama and Mistral: pre-norm decoders with grouped-query attention and rotary positions.

They differ in what their configs may ask for: Llama biases on the projections and rope
scaling ('linear', 'llama3'); Mistral one sliding window on every layer.
"""

from __future__ import annotations

from typing import Any

from vecpool.models.architectures.decoder import (
    SLIDING_ATTENTION,
    DecoderConfig,
    DecoderForCausalLM,
    DecoderForSequenceClassification,
    DecoderForTokenClassification,
    DecoderModel,
    read_config,
)

# Hugging Face's LlamaConfig / MistralConfig defaults, for keys a config.json leaves out.
_DEFAULTS: dict[str, Any] = {
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
}


class LlamaModel(DecoderModel):
    @classmethod
    def config_from_hf(cls, hf: dict[str, Any]) -> DecoderConfig:
        return read_config(
            hf,
            defaults=_DEFAULTS,
            layer_types=None,
            sliding_window=None,
            attention_bias=bool(hf.get("attention_bias", False)),
            mlp_bias=bool(hf.get("mlp_bias", False)),
        )


class LlamaForCausalLM(DecoderForCausalLM, LlamaModel):
    """Llama with its language-model head."""


class LlamaForSequenceClassification(DecoderForSequenceClassification, LlamaModel):
    """Llama scoring its last token with `score` (reward models, rerankers)."""


class LlamaForTokenClassification(DecoderForTokenClassification, LlamaModel):
    """Llama with `score` on every token row."""


class MistralModel(LlamaModel):
    @classmethod
    def config_from_hf(cls, hf: dict[str, Any]) -> DecoderConfig:
        # Absent means Hugging Face's default of 4096; null means no window. Mistral has no
        # biases, and applies the window on every layer (it ignores layer_types).
        window = hf.get("sliding_window", 4096)
        num_layers = int(hf.get("num_hidden_layers") or 0)
        return read_config(
            hf,
            defaults=_DEFAULTS,
            layer_types=[SLIDING_ATTENTION] * num_layers,
            sliding_window=None if window is None else int(window),
        )


class MistralForCausalLM(DecoderForCausalLM, MistralModel):
    """Mistral with its language-model head."""


class MistralForSequenceClassification(DecoderForSequenceClassification, MistralModel):
    """Mistral scoring its last token with `score` (reward models, rerankers)."""


class MistralForTokenClassification(DecoderForTokenClassification, MistralModel):
    """Mistral with `score` on every token row."""
