"""`TextTokenizer`: a model's `tokenizer.json` through the `tokenizers` library, with truncation
done inside the tokenizer.

A BERT normalizer (clean-up of control characters, spaces around CJK characters, accents
stripped, lowercase) is a third of tokenizing time on English text, and on printable ASCII it
does nothing but lowercase: every character is kept (none is a control character, the one
space stays a space), none is CJK, and ASCII has no accents. Such texts are tokenized by a
copy of the tokenizer whose normalizer only lowercases (or, uncased, does nothing): the same
normalized string, so the same tokens. Tabs and line breaks count as plain where the
pre-tokenizer is BERT's, which splits on them as on the space the BERT normalizer makes of
them (and no added token matched on normalized text holds whitespace). Any other text takes
the tokenizer as it is.

Large batches of single texts or of text pairs whose tokenizer is BERT's WordPiece, when only
their ids (and a pair's segment ids) are wanted, mostly skip the library altogether
(`encode_ids`, `encode_pair_ids`, `vecpool.inputs.wordpiece`).
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from tokenizers import Encoding, Tokenizer

from vecpool.errors import InputError
from vecpool.inputs.arrays import TruncationSide
from vecpool.inputs.wordpiece import ArrayWordPiece

# A batch of fewer characters is left to the library: array arithmetic's fixed cost per call
# (a few dozen NumPy operations) is more than the library's time for a few short texts.
WORDPIECE_MIN_CHARS = 1024


class TextTokenizer:
    """A `tokenizers` tokenizer, with its file's padding and truncation switched off.

    Truncation runs inside the tokenizer (in parallel, keeping the special tokens): one
    configured copy per (length, side), since a tokenizer's truncation setting is shared state.
    """

    def __init__(self, path: Path):
        self._json = path.read_text(encoding="utf-8")
        self._tok = Tokenizer.from_str(self._json)
        self._tok.no_padding()
        self._tok.no_truncation()
        # The cheaper copy for plain texts (see the module's docstring); None: no BERT normalizer.
        config = json.loads(self._json)
        twin = _plain_twin(config)
        self._plain_json: str | None = None
        self._plain_text: re.Pattern[str] = _PRINTABLE
        if twin is not None:
            self._plain_json = json.dumps(twin[0])
            self._plain_text = _PRINTABLE_AND_BREAKS if twin[1] else _PRINTABLE
        processor = self._tok.post_processor
        self.num_special_tokens = processor.num_special_tokens_to_add(False) if processor else 0
        self.num_pair_special_tokens = processor.num_special_tokens_to_add(True) if processor else 0
        self._truncating: dict[tuple[int | None, str, bool], Tokenizer] = {}
        self._lock = threading.Lock()
        # How many of a single text's special tokens come before its own tokens, and after.
        mask = self._tok.encode("a", add_special_tokens=True).special_tokens_mask
        self.num_leading_special_tokens = next(
            (i for i, special in enumerate(mask) if not special), len(mask)
        )
        self.num_trailing_special_tokens = len(mask) - 1 - self.num_leading_special_tokens
        self._wordpiece = ArrayWordPiece.build(self._json, config=config, library=self._tok)

    def encode_ids(
        self,
        texts: Sequence[str],
        max_tokens: int | None = None,
        side: TruncationSide = "right",
        add_special_tokens: bool = True,
    ) -> list[np.ndarray]:
        """Each single text's ids as an int64 array, as `encode_batch` gives them: the texts
        of a large batch of BERT's WordPiece that `ArrayWordPiece` serves by it (the same ids,
        exactly, for a fraction of the CPU), the rest by the library."""
        out: list[np.ndarray | None] | None = None
        if self._wordpiece is not None and sum(map(len, texts)) >= WORDPIECE_MIN_CHARS:
            out = self._wordpiece.encode(texts, max_tokens, side, add_special_tokens)
        if out is None:
            return id_arrays(
                self.encode_batch(texts, max_tokens, side, add_special_tokens, offsets=False)
            )
        rest = [i for i, ids in enumerate(out) if ids is None]
        if rest:
            try:
                encodings = self.encode_batch(
                    [texts[i] for i in rest], max_tokens, side, add_special_tokens, offsets=False
                )
            except InputError as exc:  # indexed within `rest`
                raise (exc if exc.index is None else exc.at(rest[exc.index])) from None
            for i, ids in zip(rest, id_arrays(encodings), strict=True):
                out[i] = ids
        return out  # type: ignore[return-value]  # every entry filled

    def encode_pair_ids(
        self, pairs: Sequence[tuple[str, str]], max_tokens: int | None, side: TruncationSide
    ) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """Each (text, text_pair)'s ids and segment ids as int64 arrays, as `encode_batch`
        gives them with special tokens: the pairs of a large batch that `ArrayWordPiece`
        serves by it, the rest by the library."""
        if not pairs:
            return [], []
        out: list[tuple[np.ndarray, np.ndarray] | None] | None = None
        if self._wordpiece is not None and sum(len(a) + len(b) for a, b in pairs) >= (
            WORDPIECE_MIN_CHARS
        ):
            out = self._wordpiece.encode_pairs(pairs, max_tokens, side)
        rest = (
            list(range(len(pairs))) if out is None else [i for i, x in enumerate(out) if x is None]
        )
        if rest:
            try:
                encodings = self.encode_batch(
                    [pairs[i] for i in rest], max_tokens, side, offsets=False
                )
            except InputError as exc:  # indexed within `rest`
                raise (exc if exc.index is None else exc.at(rest[exc.index])) from None
            filled = zip(id_arrays(encodings), _type_arrays(encodings), strict=True)
            if out is None:
                out = [None] * len(pairs)
            for i, row in zip(rest, filled, strict=True):
                out[i] = row
        assert out is not None
        return [row[0] for row in out], [row[1] for row in out]  # type: ignore[index]

    def encode_batch(
        self,
        texts: Sequence[str | tuple[str, str]],
        max_tokens: int | None = None,
        side: TruncationSide = "right",
        add_special_tokens: bool = True,
        *,
        offsets: bool = True,
    ) -> list[Encoding]:
        """Encode with special tokens (unless `add_special_tokens` is false); with
        `max_tokens`, cut only the texts' own tokens (of a (text, text_pair) pair, the longer
        text first). `offsets=False`: without the tokens' character offsets (all zero) where
        the library can leave them out (its `encode_batch_fast`; an older release computes
        them): the same ids and type ids, in encodings far cheaper to free, which the
        calling thread does holding the GIL."""

        def encode(tok: Tokenizer, batch: list[Any]) -> list[Encoding]:
            run = tok.encode_batch if offsets else getattr(tok, "encode_batch_fast", None)
            return list((run or tok.encode_batch)(batch, add_special_tokens=add_special_tokens))

        texts = list(texts)
        try:
            if offsets or self._plain_json is None:
                return encode(self._for_length(max_tokens, side), texts)
            if self._all_plain_strings(texts):  # the usual case, tested in one pass
                return encode(self._for_length(max_tokens, side, plain=True), texts)
            plain = [self._is_plain(text) for text in texts]
            if len(set(plain)) < 2:  # all of one kind: one call
                return encode(self._for_length(max_tokens, side, plain=all(plain)), texts)
            out: list[Encoding] = [None] * len(texts)  # type: ignore[list-item]
            for kind in (True, False):
                where = [i for i, p in enumerate(plain) if p is kind]
                encoded = encode(
                    self._for_length(max_tokens, side, plain=kind), [texts[i] for i in where]
                )
                for i, encoding in zip(where, encoded, strict=True):
                    out[i] = encoding
            return out
        except TypeError:  # a text that is not valid Unicode (the tokenizer takes UTF-8)
            for i, text in enumerate(texts):
                check_unicode(text, i)
            raise

    def encode_plain(self, text: str) -> Encoding:
        """`text`'s own tokens, without special tokens (with character offsets)."""
        try:
            return self._tok.encode(text, add_special_tokens=False)
        except TypeError:
            check_unicode(text, None)
            raise

    def _all_plain_strings(self, texts: list[Any]) -> bool:
        """Whether every one of `texts` is a single text that `_is_plain`: their concatenation
        is plain exactly when each of them is (the test is a run of allowed characters)."""
        try:
            joined = "".join(texts)
        except TypeError:  # text pairs among them
            return False
        return joined.isascii() and bool(self._plain_text.fullmatch(joined))

    def _is_plain(self, text: str | tuple[str, str]) -> bool:
        """Whether the cheaper copy tokenizes `text` exactly (see the module's docstring)."""
        if isinstance(text, tuple):
            return all(self._is_plain(part) for part in text)
        return isinstance(text, str) and text.isascii() and bool(self._plain_text.fullmatch(text))

    def _for_length(
        self, max_tokens: int | None, side: TruncationSide, *, plain: bool = False
    ) -> Tokenizer:
        if max_tokens is None and not plain:
            return self._tok
        if max_tokens is not None and max_tokens - self.num_special_tokens < 1:
            raise InputError(
                f"truncation to {max_tokens} tokens leaves no room besides "
                f"{self.num_special_tokens} special tokens"
            )
        key = (max_tokens, side, plain)
        with self._lock:
            tok = self._truncating.get(key)
            if tok is None:
                if len(self._truncating) >= 16:  # a few lengths are in use at any time
                    self._truncating.clear()
                source = self._plain_json if plain else self._json
                assert source is not None
                tok = Tokenizer.from_str(source)
                tok.no_padding()
                if max_tokens is None:
                    tok.no_truncation()
                else:
                    tok.enable_truncation(max_tokens, direction=side)
                self._truncating[key] = tok
        return tok

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    def special_token_ids(self) -> list[int]:
        """Ids of the tokenizer's special tokens ([CLS], [SEP], [PAD], ...)."""
        added = self._tok.get_added_tokens_decoder()
        return sorted(int(i) for i, token in added.items() if token.special)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return str(self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens))


def id_arrays(encodings: Sequence[Encoding]) -> list[np.ndarray]:
    """The encodings' ids as int64 arrays. Each list of ids is made into an array at once (the
    lists are freed while still in the cache): the ids' Python ints are most of what the GIL
    is held for in a batch's tokenizing."""
    return [np.fromiter(x, np.int64, len(x)) for x in (e.ids for e in encodings)]


def check_unicode(text: str | tuple[str, str], index: int | None) -> None:
    """`InputError` for a text that cannot be written as UTF-8 (a lone surrogate)."""
    for part in text if isinstance(text, tuple) else (text,):
        try:
            part.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise InputError(
                f"the text is not valid Unicode: {exc.reason} at character {exc.start} "
                f"({part[exc.start]!r})",
                index=index,
            ) from None


# Printable ASCII; and with tabs and line breaks too.
_PRINTABLE = re.compile(r"[\x20-\x7e]*")
_PRINTABLE_AND_BREAKS = re.compile(r"[\t\n\r\x20-\x7e]*")


def _plain_twin(config: dict[str, Any]) -> tuple[dict[str, Any], bool] | None:
    """For a tokenizer file whose normalizer is BERT's: the same file with a normalizer that
    does to printable ASCII exactly what BERT's does, and whether tabs and line breaks may
    count as plain too. None for any other normalizer."""
    normalizer = config.get("normalizer")
    if not isinstance(normalizer, dict) or normalizer.get("type") != "BertNormalizer":
        return None
    twin = dict(config)
    twin["normalizer"] = {"type": "Lowercase"} if normalizer.get("lowercase", True) else None
    pre = config.get("pre_tokenizer")
    breaks = isinstance(pre, dict) and pre.get("type") == "BertPreTokenizer"
    for token in config.get("added_tokens") or ():
        if token.get("normalized") and any(c.isspace() for c in token.get("content", "")):
            breaks = False  # matched on the normalized text, where a break became a space
    return twin, breaks


def _type_arrays(encodings: Sequence[Encoding]) -> list[np.ndarray]:
    """The encodings' segment ids as int64 arrays."""
    return [np.fromiter(x, np.int64, len(x)) for x in (e.type_ids for e in encodings)]
