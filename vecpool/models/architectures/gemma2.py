"""Gemma2: a decoder with sandwich norms, soft-capped logits and alternating sliding windows.

As in transformers, the input lookup is scaled by sqrt(hidden_size): prompt embeds are the
scaled rows, exactly what `Gemma2Model.get_input_embeddings()(ids)` gives there.
"""

from __future__ import annotations

from typing import Any

import torch

from vecpool.models.architectures.decoder import (
    FULL_ATTENTION,
    GEMMA_DEFAULTS,
    SLIDING_ATTENTION,
    DecoderConfig,
    DecoderLayer,
    DecoderModel,
    decoder_heads,
)
from vecpool.models.layers.attention import AttentionMetadata
from vecpool.models.layers.basic import RMSNorm


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
    hf_defaults = GEMMA_DEFAULTS

    @classmethod
    def config_from_hf(cls, hf: dict[str, Any]) -> DecoderConfig:
        layer_types = hf.get("layer_types")
        if layer_types is None:  # older configs: sliding windows on the even layers
            layer_types = [
                SLIDING_ATTENTION if i % 2 == 0 else FULL_ATTENTION
                for i in range(int(hf.get("num_hidden_layers") or 0))
            ]
        window = hf.get("sliding_window", 4096)
        return cls.read_config(
            hf,
            layer_types=layer_types,
            sliding_window=None if window is None else int(window),
            **gemma2_options(hf, attn_softcap=50.0, final_softcap=30.0),
        )


# Gemma2ForCausalLM's logits are soft-capped by final_logit_softcapping.
Gemma2ForCausalLM, Gemma2ForSequenceClassification, Gemma2ForTokenClassification = decoder_heads(
    Gemma2Model
)


def gemma2_options(
    hf: dict[str, Any], attn_softcap: float | None, final_softcap: float | None
) -> dict[str, Any]:
    """`read_config`'s options that Gemma2 and Gemma3 read alike: the activation under
    `hidden_activation`, the attention scale `query_pre_attn_scalar ** -0.5`, the soft caps
    (`attn_softcap` / `final_softcap` where the config leaves them out; null turns one off),
    (1 + weight) norms and the input lookup scaled by sqrt(hidden_size)."""
    attn_cap = hf.get("attn_logit_softcapping", attn_softcap)
    final_cap = hf.get("final_logit_softcapping", final_softcap)
    return {
        "hidden_act": str(hf.get("hidden_activation") or "gelu_pytorch_tanh"),
        "attention_bias": bool(hf.get("attention_bias", False)),
        "attn_scale": float(hf.get("query_pre_attn_scalar") or 256) ** -0.5,
        "attn_softcap": None if attn_cap is None else float(attn_cap),
        "final_softcap": None if final_cap is None else float(final_cap),
        "norm_unit_offset": True,
        "embed_scale": int(hf.get("hidden_size") or 0) ** 0.5,
    }
