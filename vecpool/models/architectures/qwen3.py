"""Qwen3: a pre-norm decoder with RMSNorm on each head's queries and keys (Qwen3-Embedding, which
ships under `Qwen3ForCausalLM`)."""

from __future__ import annotations

from typing import Any, ClassVar

from vecpool.models.architectures.decoder import (
    FULL_ATTENTION,
    SLIDING_ATTENTION,
    DecoderConfig,
    DecoderModel,
    decoder_heads,
)


def qwen_sliding_layers(hf: dict[str, Any]) -> tuple[list[str], int | None]:
    """(layer_types, sliding_window) of a Qwen2 / Qwen3 config: sliding windows only with
    use_sliding_window, on the layers from max_window_layers on (or as layer_types says)."""
    window = hf.get("sliding_window", 4096) if hf.get("use_sliding_window") else None
    layer_types = hf.get("layer_types")
    if layer_types is None:
        first_sliding = int(hf.get("max_window_layers", 28))
        layer_types = [
            SLIDING_ATTENTION if window is not None and i >= first_sliding else FULL_ATTENTION
            for i in range(int(hf.get("num_hidden_layers") or 0))
        ]
    return list(layer_types), None if window is None else int(window)


class Qwen3Model(DecoderModel):
    # Qwen3Config's defaults.
    hf_defaults: ClassVar[dict[str, Any]] = {**DecoderModel.hf_defaults, "head_dim": 128}

    @classmethod
    def config_from_hf(cls, hf: dict[str, Any]) -> DecoderConfig:
        layer_types, window = qwen_sliding_layers(hf)
        return cls.read_config(
            hf,
            layer_types=layer_types,
            sliding_window=window,
            attention_bias=bool(hf.get("attention_bias", False)),
            qk_norm=True,
        )


Qwen3ForCausalLM, Qwen3ForSequenceClassification, Qwen3ForTokenClassification = decoder_heads(
    Qwen3Model
)
