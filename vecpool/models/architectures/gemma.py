"""Gemma (v1): a pre-norm decoder with (1 + weight) norms and a scaled input lookup.

As in transformers, the lookup is scaled by sqrt(hidden_size): prompt embeds are the scaled
rows, exactly what `GemmaModel.get_input_embeddings()(ids)` gives there. bge-reranker-v2-gemma
is a `GemmaForCausalLM` read as a reranker (`LLMRerankerConfig.bge_gemma()`).
"""

from __future__ import annotations

from typing import Any

from vecpool.models.architectures.decoder import (
    GEMMA_DEFAULTS,
    DecoderConfig,
    DecoderModel,
    decoder_heads,
)


class GemmaModel(DecoderModel):
    """The Gemma base model."""

    hf_defaults = GEMMA_DEFAULTS

    @classmethod
    def config_from_hf(cls, hf: dict[str, Any]) -> DecoderConfig:
        # The released configs say "gelu" and mean its tanh approximation, as transformers
        # reads them.
        act = str(hf.get("hidden_act") or "gelu_pytorch_tanh")
        hidden_size = int(hf.get("hidden_size") or 0)
        return cls.read_config(
            hf,
            hidden_act="gelu_pytorch_tanh" if act == "gelu" else act,
            attention_bias=bool(hf.get("attention_bias", False)),
            norm_unit_offset=True,
            embed_scale=hidden_size**0.5,
        )


# GemmaForCausalLM: bge-reranker-v2-gemma.
GemmaForCausalLM, GemmaForSequenceClassification, GemmaForTokenClassification = decoder_heads(
    GemmaModel
)
