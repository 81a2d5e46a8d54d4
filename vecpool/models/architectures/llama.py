"""Llama and Mistral: pre-norm decoders with grouped-query attention and rotary positions.

They differ in what their configs may ask for: Llama biases on the projections and rope
scaling ('linear', 'llama3'); Mistral one sliding window on every layer.
"""

from __future__ import annotations

from typing import Any

from vecpool.models.architectures.decoder import (
    SLIDING_ATTENTION,
    DecoderConfig,
    DecoderModel,
    decoder_heads,
)


class LlamaModel(DecoderModel):
    @classmethod
    def config_from_hf(cls, hf: dict[str, Any]) -> DecoderConfig:
        return cls.read_config(
            hf,
            attention_bias=bool(hf.get("attention_bias", False)),
            mlp_bias=bool(hf.get("mlp_bias", False)),
        )


class MistralModel(LlamaModel):
    @classmethod
    def config_from_hf(cls, hf: dict[str, Any]) -> DecoderConfig:
        # Absent means Hugging Face's default of 4096; null means no window. Mistral has no
        # biases, and applies the window on every layer (it ignores layer_types).
        window = hf.get("sliding_window", 4096)
        num_layers = int(hf.get("num_hidden_layers") or 0)
        return cls.read_config(
            hf,
            layer_types=[SLIDING_ATTENTION] * num_layers,
            sliding_window=None if window is None else int(window),
        )


LlamaForCausalLM, LlamaForSequenceClassification, LlamaForTokenClassification = decoder_heads(
    LlamaModel
)
MistralForCausalLM, MistralForSequenceClassification, MistralForTokenClassification = decoder_heads(
    MistralModel
)
