"""Qwen2: a pre-norm decoder with biases on the query, key and value projections.

gte-Qwen2 and stella embedders ship it with `is_causal: false`: their attention runs both ways
(`read_config` reads the flag), and they pool by their sentence-transformers folder. Their base
tensors sit under `Qwen2ForCausalLM`.
"""

from __future__ import annotations

from typing import Any

from vecpool.models.architectures.decoder import DecoderConfig, DecoderModel, decoder_heads
from vecpool.models.architectures.qwen3 import qwen_sliding_layers


class Qwen2Model(DecoderModel):
    """The Qwen2 base model (q/k/v biases, no o_proj bias)."""

    @classmethod
    def config_from_hf(cls, hf: dict[str, Any]) -> DecoderConfig:
        layer_types, window = qwen_sliding_layers(hf)  # as Qwen3
        return cls.read_config(hf, layer_types=layer_types, sliding_window=window, qkv_bias=True)


Qwen2ForCausalLM, Qwen2ForSequenceClassification, Qwen2ForTokenClassification = decoder_heads(
    Qwen2Model
)
