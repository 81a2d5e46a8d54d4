"""A late-interaction (ColBERT-style) folder's settings resolved against its tokenizer: how the
input stage writes each side (marker id, prompt, length limit, expansion token) and which token
ids the skiplist leaves out."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from vecpool.errors import ConfigError
from vecpool.inputs.prompts import SideFormat, TextTokenizer
from vecpool.models.loading.folder import LateInteractionSpec, SideSpec
from vecpool.tasks import INPUT_TYPES

# The mask tokens of BERT-style and RoBERTa-style tokenizers, when tokenizer_config.json does
# not name one (transformers' tokenizer classes default to them).
_DEFAULT_MASK_TOKENS = ("[MASK]", "<mask>")


def side_formats(
    spec: LateInteractionSpec,
    tokenizer: TextTokenizer,
    tokenizer_config: dict[str, Any],
    *,
    max_model_len: int,
    vocab_size: int,
    causal: bool,
) -> dict[str, SideFormat]:
    """The input stage's format of each side ("query", "document")."""
    formats = {}
    for name in INPUT_TYPES:
        side = spec.side(name)
        marker_id, prompt = _marker(side, tokenizer)
        fmt = SideFormat(prompt=prompt, marker_id=marker_id, max_tokens=side.max_tokens)
        expansion = side.expansion
        if expansion is not None:
            if expansion.length > max_model_len:
                raise ConfigError(
                    f"{spec.source}: queries are expanded to {expansion.length} tokens, more "
                    f"than max_model_len={max_model_len}"
                )
            if causal and not expansion.attend:
                raise ConfigError(
                    f"{spec.source}: query expansion tokens that are not attended to need a "
                    "bidirectional encoder; this model is causal"
                )
            token = expansion.token or _expansion_token(tokenizer, tokenizer_config)
            expansion_id = tokenizer.token_to_id(token) if token is not None else None
            if expansion_id is None:
                raise ConfigError(
                    f"{spec.source}: the query expansion token {token!r} is not in the "
                    "vocabulary (the tokenizer names no mask or end-of-sequence token)"
                )
            fmt = replace(
                fmt,
                expand_to=expansion.length,
                expansion_id=expansion_id,
                attend_expansion=expansion.attend,
            )
        for token_id in (fmt.marker_id, fmt.expansion_id if expansion else None):
            if token_id is not None and token_id >= vocab_size:
                raise ConfigError(
                    f"{spec.source}: the {name} marker or expansion token id {token_id} is "
                    f"outside the model's vocabulary [0, {vocab_size})"
                )
        formats[name] = fmt
    return formats


def skiplist_ids(spec: LateInteractionSpec, tokenizer: TextTokenizer) -> list[int]:
    """The ids of the skiplist's words that are vocabulary tokens (sentence-transformers drops
    the others, which would otherwise leave out every unknown-token row)."""
    ids = (tokenizer.token_to_id(word) for word in spec.skiplist_words)
    return sorted({i for i in ids if i is not None})


def _marker(side: SideSpec, tokenizer: TextTokenizer) -> tuple[int | None, str]:
    """(marker id, text prompt) of a side. A marker that is one vocabulary token, whole or its
    first word, goes in by id right after the first token, as ColBERT and PyLate insert it (and
    as sentence-transformers makes it a single special token); the rest stays text in front of
    the input."""
    marker = side.marker or ""
    if not marker.strip():
        return None, marker + side.prompt
    for candidate in (marker, marker.split(None, 1)[0]):
        token_id = tokenizer.token_to_id(candidate)
        if token_id is not None:
            return token_id, marker[len(candidate) :].lstrip() + side.prompt
    return None, marker + side.prompt


def _expansion_token(tokenizer: TextTokenizer, tokenizer_config: dict[str, Any]) -> str | None:
    """The tokenizer's mask token, else its end-of-sequence token (PyLate's order)."""
    candidates = [_token_name(tokenizer_config.get("mask_token")), *_DEFAULT_MASK_TOKENS]
    for token in candidates:
        if token is not None and tokenizer.token_to_id(token) is not None:
            return token
    return _token_name(tokenizer_config.get("eos_token"))


def _token_name(value: Any) -> str | None:
    if isinstance(value, dict):  # an AddedToken as tokenizer_config.json stores it
        value = value.get("content")
    return value if isinstance(value, str) else None
