"""`TextTokenizer`: a model's `tokenizer.json` through the `tokenizers` library, with truncation
done inside the tokenizer."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from pathlib import Path

from tokenizers import Encoding, Tokenizer

from vecpool.arrays import TruncationSide
from vecpool.errors import InputError


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
        processor = self._tok.post_processor
        self.num_special_tokens = processor.num_special_tokens_to_add(False) if processor else 0
        self.num_pair_special_tokens = processor.num_special_tokens_to_add(True) if processor else 0
        self._truncating: dict[tuple[int, str], Tokenizer] = {}
        self._lock = threading.Lock()
        # How many of a single text's special tokens come before its own tokens, and after.
        mask = self._tok.encode("a", add_special_tokens=True).special_tokens_mask
        self.num_leading_special_tokens = next(
            (i for i, special in enumerate(mask) if not special), len(mask)
        )
        self.num_trailing_special_tokens = len(mask) - 1 - self.num_leading_special_tokens

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
        tok = self._for_length(max_tokens, side)
        encode = (
            tok.encode_batch if offsets else getattr(tok, "encode_batch_fast", tok.encode_batch)
        )
        try:
            return list(encode(list(texts), add_special_tokens=add_special_tokens))
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

    def _for_length(self, max_tokens: int | None, side: TruncationSide) -> Tokenizer:
        if max_tokens is None:
            return self._tok
        if max_tokens - self.num_special_tokens < 1:
            raise InputError(
                f"truncation to {max_tokens} tokens leaves no room besides "
                f"{self.num_special_tokens} special tokens"
            )
        key = (max_tokens, side)
        with self._lock:
            tok = self._truncating.get(key)
            if tok is None:
                if len(self._truncating) >= 16:  # a few lengths are in use at any time
                    self._truncating.clear()
                tok = Tokenizer.from_str(self._json)
                tok.no_padding()
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
