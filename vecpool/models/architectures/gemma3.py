"""Gemma3 text (and EmbeddingGemma): Gemma2's sandwich-norm layers with q/k norms, sliding and
global layers interleaved, and one rotary base for each kind.

Global layers rotate by `rope_theta` (with the config's rope scaling), sliding layers by
`rope_local_base_freq`; transformers 5 writes both under `rope_parameters`, keyed by layer type.
`use_bidirectional_attention: true` (EmbeddingGemma) attends both ways; as in transformers, its
sliding window is then `sliding_window // 2 + 1` positions either side, exclusive. The input
lookup is scaled by sqrt(hidden_size), as `Gemma3TextScaledWordEmbedding` does: prompt embeds
are the scaled rows.
"""

from __future__ import annotations

from typing import Any, ClassVar

from vecpool.models.architectures.decoder import (
    FULL_ATTENTION,
    GEMMA_DEFAULTS,
    SLIDING_ATTENTION,
    DecoderConfig,
    DecoderModel,
    decoder_heads,
)
from vecpool.models.architectures.gemma2 import Gemma2DecoderLayer, gemma2_options
from vecpool.models.base import PoolingModel
from vecpool.models.hf import hf_get
from vecpool.models.layers.basic import Rotary

_GLOBAL_THETA, _LOCAL_THETA = 1_000_000.0, 10_000.0


class Gemma3TextModel(DecoderModel):
    """The Gemma3 text model; EmbeddingGemma ships under this architecture."""

    layer_class = Gemma2DecoderLayer
    # Gemma3TextConfig's defaults.
    hf_defaults: ClassVar[dict[str, Any]] = {**GEMMA_DEFAULTS, "max_position_embeddings": 131072}

    @classmethod
    def from_hf_config(cls, hf: dict[str, Any]) -> PoolingModel:
        c = cls.config_from_hf(hf)
        rotaries = {kind: Rotary(c.head_dim, params) for kind, params in _rope(hf).items()}
        return cls(c, [rotaries[kind] for kind in _layer_types(hf)])

    @classmethod
    def config_from_hf(cls, hf: dict[str, Any]) -> DecoderConfig:
        layer_types = _layer_types(hf)
        window = hf.get("sliding_window", 4096)
        options: dict[str, Any] = {}
        if window is not None and hf.get("use_bidirectional_attention") is True:
            # transformers narrows a bidirectional Gemma3's window to W // 2 + 1 and masks
            # |i - j| < it (or <= it, under is_causal: false), `flat_attention`'s window or
            # one more.
            narrowed = int(window) // 2 + 1 + (1 if hf.get("is_causal") is False else 0)
            options["layer_windows"] = tuple(
                narrowed if t == SLIDING_ATTENTION else None for t in layer_types
            )
        return cls.read_config(
            hf,
            layer_types=layer_types,
            sliding_window=None if window is None else int(window),
            qk_norm=True,
            **gemma2_options(hf, attn_softcap=None, final_softcap=None),
            **options,
        )


# transformers names the text model's heads Gemma3ForCausalLM and
# Gemma3TextForSequenceClassification (and has no token classifier).
Gemma3ForCausalLM = decoder_heads(Gemma3TextModel, "Gemma3")[0]
Gemma3TextForSequenceClassification = decoder_heads(Gemma3TextModel)[1]


def _layer_types(hf: dict[str, Any]) -> list[str]:
    """Each layer's kind; older configs give a pattern: every n-th layer global (n = 6)."""
    layer_types = hf.get("layer_types")
    if layer_types is not None:
        return list(layer_types)
    pattern = int(hf.get("sliding_window_pattern") or 6)
    return [
        SLIDING_ATTENTION if (i + 1) % pattern else FULL_ATTENTION
        for i in range(int(hf.get("num_hidden_layers") or 0))
    ]


def _rope(hf: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """{layer kind: the config `Rotary` reads for it}: transformers 5's `rope_parameters` by
    layer kind, or the older flat keys (`rope_theta` and `rope_scaling` for global layers,
    `rope_local_base_freq` for sliding ones)."""
    params = dict(hf.get("rope_parameters") or {})
    if params.keys() & {FULL_ATTENTION, SLIDING_ATTENTION}:
        full = dict(params.get(FULL_ATTENTION) or {})
        sliding = dict(params.get(SLIDING_ATTENTION) or {})
    else:
        full, sliding = {**(hf.get("rope_scaling") or {}), **params}, {}
    full.setdefault("rope_theta", hf.get("rope_theta") or _GLOBAL_THETA)
    sliding.setdefault("rope_theta", hf.get("rope_local_base_freq") or _LOCAL_THETA)
    shared = {"partial_rotary_factor": hf_get(hf, "partial_rotary_factor", default=1.0)}
    return {
        FULL_ATTENTION: {**shared, "rope_parameters": full},
        SLIDING_ATTENTION: {**shared, "rope_parameters": sliding},
    }
