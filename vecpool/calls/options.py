"""What each task call accepts: one frozen options object per task, with its defaults and the
checks that need no model, declared once here and read by `Engine`'s methods, the `prepare_*`
functions, the HTTP routes, Ray and the command line.

`Engine`'s methods keep their keyword signatures (the public API) and build their task's
options from them in one place (`Options.of(locals())`); a test holds each method's keywords
and defaults equal to its options' fields. An entry point builds its task's options once, from
its request or its arguments, and hands them to a `prepare_*` function, or to the Engine's
method as `options.keywords()`.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from typing import Any, TypeVar

import numpy as np

from vecpool.errors import InputError, check_flag
from vecpool.inputs.arrays import TruncationSide

OptionsT = TypeVar("OptionsT", bound="Options")
T = TypeVar("T")


def fields_from(cls: type[T], source: object, **values: Any) -> T:
    """A `cls` dataclass of `values`, each field they leave out taken from `source`'s attribute
    of that name where it has one (else left at its default)."""
    for field in fields(cls):  # type: ignore[arg-type]
        if field.name not in values and hasattr(source, field.name):
            values[field.name] = getattr(source, field.name)
    return cls(**values)


@dataclass(frozen=True)
class Options:
    """The options every task shares: how text inputs are cut to the model's limit."""

    truncate_prompt_tokens: int | None = None  # keep this many tokens; -1: the model's limit
    truncation_side: TruncationSide = "right"  # "right" keeps the start, "left" the end

    @classmethod
    def of(cls: type[OptionsT], values: Mapping[str, Any]) -> OptionsT:
        """The options named in `values` (a caller's keywords; other names are left out)."""
        return cls(**{name: values[name] for name in _field_names(cls) if name in values})

    @classmethod
    def build(
        cls: type[OptionsT], options: OptionsT | None, keywords: Mapping[str, Any]
    ) -> OptionsT:
        """`options` (or the defaults) with `keywords` over them: what a `prepare_*` function
        takes, an options object, keywords, or both."""
        base = options if options is not None else cls()
        return replace(base, **keywords) if keywords else base

    def keywords(self) -> dict[str, Any]:
        """The options set away from their defaults, by name: the keywords of the task's
        `Engine` method that give this call (fields the method lacks are left at defaults)."""
        out = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if value is f.default or (f.default is not None and value == f.default):
                continue
            out[f.name] = value
        return out


@dataclass(frozen=True)
class EncodeOptions(Options):
    """`encode` (and the "embed" task under `embed`): a task's raw output per input."""

    task: str = "token_embed"
    dimensions: int | None = None  # a matryoshka truncation of the vectors
    normalize: bool | None = None  # None: as the model does
    step_tag_id: int | None = None  # token_classify: only the positions of this token
    use_activation: bool | None = None  # None: as the model does
    input_type: str | None = None  # a late-interaction model's side: "query" or "document"
    exclude_special_tokens: bool | None = None
    prompt_name: str | None = None  # the folder's instruction prompt of this name
    prompt: str | None = None  # an instruction prompt of the call's own
    add_special_tokens: bool = True  # False: a text becomes its own tokens only
    matryoshka_only: bool = False  # `dimensions` only for a folder that declares matryoshka


@dataclass(frozen=True)
class EmbedOptions(Options):
    """`embed`: one vector per input, optionally windowed or quantized."""

    dimensions: int | None = None
    normalize: bool | None = None
    prompt_name: str | None = None
    prompt: str | None = None
    precision: str = "float32"  # or "int8", "uint8", "binary", "ubinary"
    ranges: np.ndarray | None = None  # [2, dim]: int8 / uint8 per-dimension minimum, maximum
    windowed: bool | None = None  # None: the engine's `windowed_embed`
    add_special_tokens: bool = True
    matryoshka_only: bool = False

    def __post_init__(self) -> None:
        if self.windowed is not None:
            check_flag(self.windowed, "windowed")

    def encode(self) -> EncodeOptions:
        """The same call as `encode` options of the "embed" task."""
        return EncodeOptions.of({**vars(self), "task": "embed"})


@dataclass(frozen=True)
class ClassifyOptions(Options):
    """`classify`: class scores per input."""

    use_activation: bool | None = None  # False: raw logits
    add_special_tokens: bool = True


@dataclass(frozen=True)
class ScoreOptions(Options):
    """`score`: one score per pair."""

    use_activation: bool | None = None
    one_score: bool = False  # refuse a classifier with several labels (one score per pair)


@dataclass(frozen=True)
class RerankOptions(Options):
    """`rerank`: documents by their score for one query."""

    top_n: int | None = None  # the best `top_n` documents (None or 0: all)
    use_activation: bool | None = None
    max_tokens_per_doc: int | None = None  # each document cut to this many tokens first

    def __post_init__(self) -> None:
        check_top_n(self.top_n)

    def score(self) -> ScoreOptions:
        """The options of scoring the query against each document."""
        return ScoreOptions.of(vars(self))


@dataclass(frozen=True)
class SparseOptions(Options):
    """`embed_sparse`: vocabulary weights per input."""

    top_k: int | None = None  # the `top_k` largest weights (None: every one over threshold)
    threshold: float = 0.0  # weights at or below it are left out
    return_tokens: bool = False  # token strings for keys instead of vocabulary ids
    exclude_special_tokens: bool = False
    prompt_name: str | None = None
    prompt: str | None = None

    def __post_init__(self) -> None:
        check_top_k(self.top_k)
        t = self.threshold
        if isinstance(t, bool) or not isinstance(t, numbers.Real) or not math.isfinite(t):
            raise InputError(f"must be a finite number, got {t!r}", field="threshold")
        check_flag(self.return_tokens, "return_tokens")
        check_flag(self.exclude_special_tokens, "exclude_special_tokens")


def check_top_n(top_n: Any) -> None:
    """`top_n` of a rerank call: None or 0 for every document, else how many to return."""
    if top_n is not None and (isinstance(top_n, bool) or not isinstance(top_n, int) or top_n < 0):
        raise InputError(
            f"top_n must be a non-negative integer (0: every document), got {top_n!r}",
            field="top_n",
        )


def check_top_k(top_k: Any) -> None:
    """`top_k` of a sparse call: None for every weight above the threshold, else how many."""
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0):
        raise InputError(f"top_k must be a non-negative integer, got {top_k!r}", field="top_k")


_FIELD_NAMES: dict[type, tuple[str, ...]] = {}


def _field_names(cls: type) -> tuple[str, ...]:
    """A dataclass's field names, read once (`dataclasses.fields` walks them anew on every
    call, once or twice per request of a server)."""
    names = _FIELD_NAMES.get(cls)
    if names is None:
        names = _FIELD_NAMES[cls] = tuple(f.name for f in fields(cls))
    return names
