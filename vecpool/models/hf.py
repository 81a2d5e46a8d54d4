"""Reading Hugging Face `config.json` dicts: the helpers every architecture shares."""

from __future__ import annotations

from typing import Any


def hf_get(hf: dict[str, Any], *names: str, default: Any = None) -> Any:
    """The first of `names` present (and not None) in a Hugging Face config dict."""
    for name in names:
        value = hf.get(name)
        if value is not None:
            return value
    return default
