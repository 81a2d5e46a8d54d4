"""Reading Hugging Face `config.json` dicts: the helpers every architecture shares."""

from __future__ import annotations

from typing import Any

# The `quantization_config` methods whose checkpoints load (their FP8 forms:
# `quant.quant_checkpoint`); a decoder's config naming another is refused.
CHECKPOINT_QUANT_METHODS = ("compressed-tensors", "fp8")


def hf_get(hf: dict[str, Any], *names: str, default: Any = None) -> Any:
    """The first of `names` present (and not None) in a Hugging Face config dict."""
    for name in names:
        value = hf.get(name)
        if value is not None:
            return value
    return default
