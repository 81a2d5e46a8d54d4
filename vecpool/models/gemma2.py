"""Gemma2: a decoder with sandwich norms, soft-capped logits and alternating sliding windows.

As in transformers, the input lookup is scaled by sqrt(hidden_size): prompt embeds are the
scaled rows, exactly what `Gemma2Model.get_input_embeddings()(ids)` gives there.
"""

from __future__ import annotations

from typing import Any

import torch

from vecpool.models.attention import AttentionMetadata
from vecpool.models.decoder import (
    FULL_ATTENTION,
    SLIDING_ATTENTION,
    DecoderConfig,
    DecoderForCausalLM,
    DecoderForSequenceClassification,
    DecoderForTokenClassification,
    DecoderLayer,
    DecoderModel,
    read_config,
)
from vecpool.models.layers import RMSNorm

# Hugging Face's Gemma2Config defaults, for keys a config.json leaves out.
_DEFAULTS: dict[str, Any] = {
    "head_dim": 256,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
}


class Gemma2DecoderLayer(DecoderLayer):
    """Norms on both sides of attention and of the MLP; `post_attention_layernorm` normalizes
    the attention output (in Llama it precedes the MLP)."""

    def __init__(self, c: DecoderConfig, window: int | None):
        super().__init__(c, window)
        self.pre_feedforward_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, unit_offset=True)
        self.post_feedforward_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, unit_offset=True)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: AttentionMetadata
    ) -> torch.Tensor:
        h = self.self_attn(self.input_layernorm(x), cos, sin, attn)
        x = x + self.post_attention_layernorm(h)
        h = self.mlp(self.pre_feedforward_layernorm(x))
        return x + self.post_feedforward_layernorm(h)


class Gemma2Model(DecoderModel):
    layer_class = Gemma2DecoderLayer

    @classmethod
    def config_from_hf(cls, hf: dict[str, Any]) -> DecoderConfig:
        layer_types = hf.get("layer_types")
        if layer_types is None:  # older configs: sliding windows on the even layers
            layer_types = [
                SLIDING_ATTENTION if i % 2 == 0 else FULL_ATTENTION
                for i in range(int(hf.get("num_hidden_layers") or 0))
            ]
        window = hf.get("sliding_window", 4096)
        hidden_size = int(hf.get("hidden_size") or 0)
        return read_config(
            hf,
            defaults=_DEFAULTS,
            layer_types=layer_types,
            sliding_window=None if window is None else int(window),
            hidden_act=str(hf.get("hidden_activation") or "gelu_pytorch_tanh"),
            attention_bias=bool(hf.get("attention_bias", False)),
            attn_scale=float(hf.get("query_pre_attn_scalar", 256)) ** -0.5,
            attn_softcap=_optional_float(hf.get("attn_logit_softcapping", 50.0)),
            final_softcap=_optional_float(hf.get("final_logit_softcapping", 30.0)),
            norm_unit_offset=True,
            embed_scale=hidden_size**0.5,
        )


class Gemma2ForCausalLM(DecoderForCausalLM, Gemma2Model):
    """Gemma2 with its language-model head; logits soft-capped by final_logit_softcapping."""


class Gemma2ForSequenceClassification(DecoderForSequenceClassification, Gemma2Model):
    """Gemma2 scoring its last token with `score` (reward models, rerankers)."""


class Gemma2ForTokenClassification(DecoderForTokenClassification, Gemma2Model):
    """Gemma2 with `score` on every token row."""


def _optional_float(value: Any) -> float | None:
    return None if value is None else float(value)
