"""`ArrayWordPiece`: BERT's WordPiece tokenizing as array arithmetic over a whole batch, giving
exactly the ids that the `tokenizers` library gives, at a small part of its cost.

The `tokenizers` library spends about 2.5 µs of a core per token on BERT's tokenizer (most of it
in the string bookkeeping of its normalizer, pre-tokenizer and encodings), so that on a GPU
small encoders embed token ids faster than their host can tokenize texts. Its steps are simple
enough to run on a batch's bytes at once:

- BERT's normalizer lowercases ASCII (the module `vecpool.inputs.tokenizer` says why that is all it
  does there), which `str.lower` does the same way;
- BERT's pre-tokenizer makes words of the maximal runs of letters and digits and of each other
  printable character (every one of them is punctuation to it), dropping whitespace;
- WordPiece gives a word that is in the vocabulary its own id, a word longer than
  `max_input_chars_per_word` characters the unknown token, and any other word its greedy
  longest-prefix pieces (the unknown token if some part matches nothing).

A character outside ASCII is asked of the library itself the first time it is met
(`_describe`): what its normalizer makes of it (an accent stripped, a letter lowercased, a
CJK character spaced out, a format character removed), checked to be the same beside other
characters, and what its pre-tokenizer makes of each resulting character (part of a word,
isolated as punctuation, or whitespace). A text is then translated into its normalized form,
and into bytes with one stand-in byte per character outside ASCII, of the class it has.

Words are found by comparing neighbouring bytes' classes. A word's vocabulary id comes from a
table of the vocabulary's whole words keyed by their bytes themselves (three 64-bit integers,
zero past the word's end: no hash that two strings could share), so a word found there is that
entry. A word not there (longer than 24 bytes, holding a stand-in, or not in the vocabulary as
a whole) takes WordPiece's own loop in Python on the vocabulary's dictionary and the normalized
text, its result cached: a text's rare words are few, and repeat. The template's special
tokens, and the truncation, are index arithmetic on the flat result. A text pair (a
cross-encoder's query and document, `encode_pairs`) is its two texts tokenized so, then the pair
template's special tokens and segment ids, and the library's longest-first truncation (the
shorter text whole where the longer can give up the rest, else half each), in the same way. The
batch is one `str`, so the work holds the interpreter lock for a few dozen array operations
(NumPy releases it inside most of them), the translation of texts outside ASCII and the loop
over rare words.

What it serves is checked when it is built and per text: a `tokenizer.json` of BERT's
normalizer, pre-tokenizer and WordPiece model whose post-processor wraps a single text in fixed
special tokens of segment 0 (and pairs where it puts fixed special tokens before, between and
after the two texts, each part of one segment); texts with no ASCII control character but tabs
and line breaks, no character that the library normalizes differently by its neighbours
(combining marks) or that it cannot take (a lone surrogate), and no added token's text (in any
case, before or after normalizing, tabs and line breaks read as spaces). Any other text is
`None`, and the caller tokenizes it with the library.
"""

from __future__ import annotations

import itertools
import json
import re
import unicodedata
from collections.abc import Sequence
from typing import Any

import numpy as np
from tokenizers import Tokenizer

from vecpool.inputs.arrays import TruncationSide
from vecpool.inputs.wordpiece_pairs import PairTemplate, read_pair_template

# Byte classes: 0 whitespace, 1 part of a word (a letter or digit, or the stand-in of a
# character outside ASCII that is), 2 punctuation (any other printable ASCII, or the stand-in
# of a character outside ASCII that the pre-tokenizer isolates), 3 the separator between texts,
# 4 anything else (never there: texts holding ASCII control characters are not served).
_CLASS = np.full(256, 4, dtype=np.uint8)
_CLASS[[0x09, 0x0A, 0x0D, 0x20]] = 0
_CLASS[0x21:0x7F] = 2
for _lo, _hi in ((0x30, 0x39), (0x41, 0x5A), (0x61, 0x7A)):
    _CLASS[_lo : _hi + 1] = 1
_CLASS[0] = 3
_WORD, _ISOLATED = "\x01", "\x02"  # the stand-ins
_CLASS[1], _CLASS[2] = 1, 2
_SEPARATOR = "\x00"
_BREAKS_AS_SPACES = str.maketrans("\t\n\r", "   ")
_CONTROL = re.compile(r"[\x01-\x08\x0b\x0c\x0e-\x1f\x7f]")  # besides the separator
# The same as bytes: deleting them from a batch's bytes (`bytes.translate`, one pass in C)
# finds one for less than the pattern's search of the batch's text.
_CONTROL_BYTES = bytes([*range(0x01, 0x09), 0x0B, 0x0C, *range(0x0E, 0x20), 0x7F])
_NON_ASCII = re.compile(r"[^\x00-\x7f]")
_CHARS = 1 << 16  # characters outside ASCII described at most (then such texts are not served)

# A whole word of the vocabulary is looked up by its bytes themselves, as `_LIMBS` little-endian
# 64-bit integers zero-filled past its end (words hold no zero byte, so that is exact); longer
# entries are left to the exact path. The limbs, mixed, pick the word's first slot.
_LIMBS = 3
_MIX = np.array([0x9E3779B97F4A7C15, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9], dtype=np.uint64)
_CACHE_WORDS = 1 << 16  # rare words' pieces kept between calls


def _limbs(data: bytes, starts: np.ndarray, lengths: np.ndarray) -> list[np.ndarray]:
    """`_LIMBS` `[W]` uint64 arrays: the bytes of each word (`data[start : start + length]`),
    zero past its length or past `_LIMBS * 8` bytes. `data` must have `_LIMBS * 8` bytes of
    room after its last word."""
    # The 8 bytes from each offset of `data`, as one unaligned array.
    words = np.ndarray((len(data) - 7,), dtype="<u8", buffer=data, strides=(1,))
    first = words[starts]
    first &= _KEEP[np.minimum(lengths, 8), 0]
    out = [first]
    for j in range(1, _LIMBS):  # only the words that reach this far (few)
        limb = np.zeros_like(first)
        longer = np.flatnonzero(lengths > 8 * j)
        limb[longer] = (
            words[starts[longer] + 8 * j] & _KEEP[np.minimum(lengths[longer], _LIMBS * 8), j]
        )
        out.append(limb)
    return out


def _slots(limbs: list[np.ndarray], bits: int) -> np.ndarray:
    """Each word's first slot in a table of `2**bits` slots."""
    with np.errstate(over="ignore"):
        mixed = limbs[0] * _MIX[0]
        for j in range(1, _LIMBS):
            mixed ^= limbs[j] * _MIX[j]
    return (mixed >> np.uint64(64 - bits)).astype(np.int64)


# `_KEEP[n]`: the limbs' masks of a word of n bytes.
_KEEP = np.array(
    [
        [(1 << (8 * min(max(n - 8 * j, 0), 8))) - 1 for j in range(_LIMBS)]
        for n in range(_LIMBS * 8 + 1)
    ],
    dtype=np.uint64,
)


class ArrayWordPiece:
    """Exact WordPiece ids of single texts and of text pairs, for one `tokenizer.json` of
    BERT's kind (see the module's docstring). Build with `build`; `encode` and `encode_pairs`
    give None where they do not apply."""

    def __init__(
        self,
        vocab: dict[str, int],
        *,
        lowercase: bool,
        unk_id: int,
        prefix: str,
        max_word_chars: int,
        leading: list[int],
        trailing: list[int],
        added: list[str],
        library: Tokenizer,
        pair: PairTemplate | None = None,
    ):
        self._vocab = vocab
        # Characters outside ASCII, described as the library normalizes and splits them
        # (`_describe`), as they are first met.
        self._library = library
        self._normalize: dict[str, str] = {}
        self._stand_in: dict[str, str] = {}
        self._unserved: set[str] = set()
        self._lowercase = lowercase
        self._unk_id = unk_id
        self._prefix = prefix
        self._max_word_chars = max_word_chars
        self._leading = np.asarray(leading, dtype=np.int64)
        self._trailing = np.asarray(trailing, dtype=np.int64)
        self._pair = pair
        # Added tokens are matched before anything else, some on the normalized text (where
        # tabs and line breaks are spaces): a text that holds one's text in any case, with
        # breaks read as spaces where one holds whitespace, is left to the library.
        self._added = (
            re.compile("|".join(re.escape(a.lower()) for a in sorted(added, key=len)[::-1]))
            if added
            else None
        )
        self._added_spaces = any(c.isspace() for a in added for c in a)
        # Their first characters: a text holding none of them (BERT's all begin with "[")
        # needs no search.
        self._added_firsts = {a.lower()[0] for a in added}
        # Whole words of the vocabulary (those a pre-tokenized ASCII word can be, and no
        # longer than the limbs) in an open-addressing table probed linearly; -1 is empty.
        words = sorted(w for w in vocab if w.isascii() and len(w) <= _LIMBS * 8 and _is_word(w))
        self._bits = max(4, (4 * len(words)).bit_length())
        size = 1 << self._bits
        self._slots = np.full(size, -1, dtype=np.int64)
        raw = "".join(words).encode("ascii") + bytes(_LIMBS * 8)
        lengths = np.array([len(w) for w in words], dtype=np.int64)
        self._entries = _limbs(raw, np.cumsum(lengths) - lengths, lengths)
        self._ids = np.array([vocab[w] for w in words], dtype=np.int64)
        # Placed in rounds: of the words whose next slot is empty, the first takes it, and
        # the rest move one slot on (so every slot a word passes is filled).
        slot = _slots(self._entries, self._bits)
        pending = np.arange(len(words))
        self._probes = 1  # the longest run of probes a vocabulary word needs
        while pending.size:
            at = slot[pending]
            empty = self._slots[at] < 0
            taken, first = np.unique(at[empty], return_index=True)
            self._slots[taken] = pending[empty][first]
            pending = pending[self._slots[at] != pending]
            slot[pending] = (slot[pending] + 1) & (size - 1)
            self._probes += bool(pending.size)
        self._pieces: dict[str, tuple[int, ...]] = {}

    @classmethod
    def build(
        cls,
        tokenizer_json: str,
        *,
        config: dict[str, Any] | None = None,
        library: Tokenizer | None = None,
    ) -> ArrayWordPiece | None:
        """The fast path for this tokenizer file, or None where it does not apply. `config`:
        the file parsed, and `library`: the library's tokenizer of it, without padding or
        truncation, where the caller has them already."""
        config = json.loads(tokenizer_json) if config is None else config
        normalizer = config.get("normalizer")
        model = config.get("model") or {}
        if (
            not isinstance(normalizer, dict)
            or normalizer.get("type") != "BertNormalizer"
            or (config.get("pre_tokenizer") or {}).get("type") != "BertPreTokenizer"
            or model.get("type") != "WordPiece"
            or not isinstance(model.get("vocab"), dict)
            or model.get("unk_token") not in model["vocab"]
        ):
            return None
        tok = library
        if tok is None:
            tok = Tokenizer.from_str(tokenizer_json)
            tok.no_padding()
            tok.no_truncation()
        # The post-processor's special tokens around one text, read off two probes; they must
        # wrap any text the same way, all in segment 0.
        templates = []
        for probe in ("a", "the end"):
            full = tok.encode(probe)
            own = tok.encode(probe, add_special_tokens=False).ids
            ids = full.ids
            at = next((i for i in range(len(ids)) if ids[i : i + len(own)] == own), None)
            if at is None or any(full.type_ids):
                return None
            templates.append((ids[:at], ids[at + len(own) :]))
        if templates[0] != templates[1]:
            return None
        leading, trailing = templates[0]
        pairs = [read_pair_template(tok, a, b) for a, b in (("a", "the end"), ("b c", "d"))]
        pair = pairs[0] if pairs[0] is not None and pairs[0] == pairs[1] else None
        added = [t["content"] for t in config.get("added_tokens") or () if t.get("content")]
        return cls(
            model["vocab"],
            lowercase=bool(normalizer.get("lowercase", True)),
            unk_id=int(model["vocab"][model["unk_token"]]),
            prefix=str(model.get("continuing_subword_prefix", "##")),
            max_word_chars=int(model.get("max_input_chars_per_word", 100)),
            leading=leading,
            trailing=trailing,
            added=added,
            library=tok,
            pair=pair,
        )

    def encode(
        self,
        texts: Sequence[str],
        max_tokens: int | None = None,
        side: TruncationSide = "right",
        add_special_tokens: bool = True,
    ) -> list[np.ndarray | None] | None:
        """Each text's ids (int64), as the library encodes it, truncated to `max_tokens`
        tokens in all (the special tokens kept) from `side`; None in place of a text that is
        not served (`_normalize_one`). None for the whole batch where one of them is not a
        `str`, or `max_tokens` leaves no room besides the special tokens."""
        extra = (self._leading.size + self._trailing.size) if add_special_tokens else 0
        if max_tokens is not None and max_tokens - extra < 1:
            return None
        if not texts or not all(isinstance(t, str) for t in texts):
            return None
        joined = self._plain_batch(texts)
        served: list[int] | None = None
        if joined is None:  # text by text
            parts = [self._normalize_one(text) for text in texts]
            served = [i for i, part in enumerate(parts) if part is not None]
            if not served:
                return [None] * len(texts)
            ready = [parts[i] for i in served]
            normalized = _SEPARATOR.join(n for n, _ in ready)  # type: ignore[misc]
            stand_ins = _SEPARATOR.join(s for _, s in ready)  # type: ignore[misc]
            joined = normalized, stand_ins
        ids = self._encode_normalized(
            *joined, len(served or texts), max_tokens, side, add_special_tokens
        )
        if served is None:
            return list(ids)
        every: list[np.ndarray | None] = [None] * len(texts)
        for i, row in zip(served, ids, strict=True):
            every[i] = row
        return every

    def encode_pairs(
        self,
        pairs: Sequence[tuple[str, str]],
        max_tokens: int | None = None,
        side: TruncationSide = "right",
    ) -> list[tuple[np.ndarray, np.ndarray] | None] | None:
        """Each (text, text_pair)'s ids and segment ids (int64), as the library encodes the
        pair with its special tokens, truncated to `max_tokens` tokens in all, longest text
        first, from `side`; None in place of a pair either of whose texts is not served. None
        for the whole batch where the tokenizer has no fixed pair template, a pair is not two
        `str`, or `max_tokens` leaves no room for one token of each text."""
        template = self._pair
        if template is None or not pairs:
            return None
        if max_tokens is not None and max_tokens - template.num_special < 2:
            return None
        if not all(isinstance(p, tuple) and len(p) == 2 for p in pairs):
            return None
        parts = self.encode([text for pair in pairs for text in pair], add_special_tokens=False)
        if parts is None:
            return None
        return template.join(parts, max_tokens, side)

    def _plain_batch(self, texts: Sequence[str]) -> tuple[str, str] | None:
        """For a batch of ASCII texts every one of which is served, the texts joined,
        normalized (twice: as text and as stand-ins, the same here); else None."""
        joined = _SEPARATOR.join(texts)
        if not joined.isascii() or joined.count(_SEPARATOR) != len(texts) - 1 or not all(texts):
            return None
        raw = joined.encode("ascii")
        if len(raw.translate(None, _CONTROL_BYTES)) != len(raw):
            return None
        normalized = joined.lower() if self._lowercase else joined
        if self._has_added(normalized if self._lowercase else joined.lower()):
            return None
        return normalized, normalized

    def _has_added(self, lowered: str) -> bool:
        """Whether a lowercased text holds an added token's text (breaks read as spaces where
        an added token holds whitespace)."""
        if self._added is None:
            return False
        seen = lowered.translate(_BREAKS_AS_SPACES) if self._added_spaces else lowered
        if not any(first in seen for first in self._added_firsts):
            return False
        return self._added.search(seen) is not None

    def _normalize_one(self, text: str) -> tuple[str, str] | None:
        """A text normalized as the library normalizes it, and the same with each character
        outside ASCII as its stand-in (`_describe`); None where the text is not served: empty,
        holding the separator, an ASCII control character, a character not served, or an added
        token's text (in any case, before or after normalizing)."""
        if not text or _SEPARATOR in text or _CONTROL.search(text):
            return None
        if text.isascii():
            normalized = text.lower() if self._lowercase else text
            lowered = normalized if self._lowercase else text.lower()
            return None if self._has_added(lowered) else (normalized, normalized)
        for char in set(_NON_ASCII.findall(text)):
            if char not in self._normalize and not self._describe(char):
                return None
        # Character by character outside ASCII (`str.translate` takes far longer on such a
        # text); then ASCII lowercased, which leaves the library's lowercase alone.
        normalized = _NON_ASCII.sub(self._normalized_char, text)
        if self._lowercase:
            normalized = normalized.lower()
        if self._has_added(text.lower()) or self._has_added(normalized.lower()):
            return None
        return normalized, _NON_ASCII.sub(self._stand_in_char, normalized)

    def _normalized_char(self, match: re.Match[str]) -> str:
        return self._normalize[match.group()]

    def _stand_in_char(self, match: re.Match[str]) -> str:
        return self._stand_in[match.group()]

    def _describe(self, char: str) -> bool:
        """Learn what the library's normalizer makes of a character outside ASCII, and what
        its pre-tokenizer makes of each character of that: whether it is served. It is when it
        normalizes alike in any neighbourhood (two probes; never a combining mark) and each
        character it becomes is ASCII, or a part of a word, or isolated, or whitespace."""
        if char in self._unserved:
            return False
        served = False
        try:
            normalizer = self._library.normalizer
            pre_tokenizer = self._library.pre_tokenizer
            assert normalizer is not None and pre_tokenizer is not None
            into = normalizer.normalize_str(char)
            stand_in = []
            if (
                not unicodedata.category(char).startswith("M")
                and (into.lower() == into or not self._lowercase)
                and normalizer.normalize_str(f"a{char}b") == f"a{into}b"
                and normalizer.normalize_str(char + char) == into + into
                and len(self._normalize) < _CHARS
            ):
                for c in into:
                    if c.isascii():
                        stand_in.append(c)
                        continue
                    words = [w for w, _ in pre_tokenizer.pre_tokenize_str(f"a{c}a")]
                    if unicodedata.category(c).startswith("M"):
                        break
                    if words == [f"a{c}a"]:
                        stand_in.append(_WORD)
                    elif words == ["a", c, "a"]:
                        stand_in.append(_ISOLATED)
                    elif words == ["a", "a"]:
                        stand_in.append(" ")
                    else:
                        break
                else:
                    served = True
        except (TypeError, ValueError, UnicodeError):  # a lone surrogate, say
            served = False
        if not served:
            self._unserved.add(char)
            return False
        for c, s in zip(into, stand_in, strict=True):
            if not c.isascii():
                self._stand_in[c] = s
        self._normalize[char] = into
        return True

    def _encode_normalized(
        self,
        normalized: str,
        stand_ins: str,
        num_texts: int,
        max_tokens: int | None,
        side: TruncationSide,
        add_special_tokens: bool,
    ) -> list[np.ndarray]:
        """`encode` of served texts, joined and normalized (`_plain_batch`, `_normalize_one`)."""
        raw = stand_ins.encode("ascii")
        kind = _CLASS[np.frombuffer(raw, dtype=np.uint8)]
        words, text_of_word = self._words(kind, num_texts)
        ids, counts, rare = self._lookup(raw + bytes(_LIMBS * 8), normalized, words)
        flat = self._flatten(ids, counts, rare)
        return self._assemble(
            flat, counts, text_of_word, num_texts, max_tokens, side, add_special_tokens
        )

    def _words(self, kind: np.ndarray, num_texts: int) -> tuple[np.ndarray, np.ndarray]:
        """The words' `[2, W]` byte bounds (start, end) and each word's text."""
        if not kind.size:  # one text, all of it removed by the normalizer
            return np.zeros((2, 0), dtype=np.int64), np.zeros(0, dtype=np.int64)
        alnum = kind == 1
        punct = kind == 2
        starts = punct.copy()
        starts[0] |= alnum[0]
        starts[1:] |= alnum[1:] & ~alnum[:-1]
        ends = punct.copy()
        ends[-1] |= alnum[-1]
        ends[:-1] |= alnum[:-1] & ~alnum[1:]
        bounds = np.empty((2, int(np.count_nonzero(starts))), dtype=np.int64)
        bounds[0] = np.flatnonzero(starts)
        bounds[1] = np.flatnonzero(ends)
        bounds[1] += 1
        if num_texts == 1:
            return bounds, np.zeros(bounds.shape[1], dtype=np.int64)
        return bounds, np.searchsorted(np.flatnonzero(kind == 3), bounds[0])

    def _find(self, data: bytes, bounds: np.ndarray) -> np.ndarray:
        """Each word's index among the table's words, -1 where it is none of them."""
        lengths = bounds[1] - bounds[0]
        limbs = _limbs(data, bounds[0], lengths)
        slot = _slots(limbs, self._bits)
        entry = self._slots[slot]
        hit = self._matches(entry, limbs)
        # Words of a filled slot holding another entry probe on; a slot left empty ends the
        # probing of its word (and a word longer than the limbs matches no entry).
        todo = np.flatnonzero(~hit & (entry >= 0))
        entry[~hit] = -1
        slot = slot[todo]
        for _ in range(self._probes - 1):
            if not todo.size:
                break
            slot = (slot + 1) & (self._slots.size - 1)
            at = self._slots[slot]
            found = self._matches(at, [limb[todo] for limb in limbs])
            entry[todo[found]] = at[found]
            more = ~found & (at >= 0)
            todo, slot = todo[more], slot[more]
        return entry

    def _matches(self, at: np.ndarray, limbs: list[np.ndarray]) -> np.ndarray:
        """Whether each word equals the entry `at` (-1: none)."""
        same = at >= 0
        for entries, limb in zip(self._entries, limbs, strict=True):
            same &= entries[at] == limb
        return same

    def _lookup(
        self, data: bytes, joined: str, bounds: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray, tuple[np.ndarray, list[tuple[int, ...]]]]:
        """Each word's id (`[W]`; a rare word's entry unused), each word's token count, and
        the rare words: their indices and pieces."""
        entry = self._find(data, bounds)
        found = entry >= 0
        ids = self._ids[entry]
        lengths = bounds[1] - bounds[0]
        too_long = lengths > self._max_word_chars
        ids[too_long] = self._unk_id
        rare = np.flatnonzero(~found & ~too_long)
        counts = np.ones(bounds.shape[1], dtype=np.int64)
        words = map(
            joined.__getitem__, map(slice, bounds[0, rare].tolist(), bounds[1, rare].tolist())
        )
        cached, split = self._pieces.get, self._wordpiece
        pieces = [cached(word) or split(word) for word in words]
        if pieces:
            counts[rare] = list(map(len, pieces))
        return ids, counts, (rare, pieces)

    def _wordpiece(self, word: str) -> tuple[int, ...]:
        """WordPiece's greedy longest-prefix pieces of a word of at most `max_word_chars`
        characters, or the unknown token alone if some part matches no entry; cached."""
        vocab, out, start = self._vocab, [], 0
        while start < len(word):
            end = len(word)
            while end > start:
                piece = word[start:end] if start == 0 else self._prefix + word[start:end]
                token = vocab.get(piece)
                if token is not None:
                    out.append(token)
                    break
                end -= 1
            else:
                out = [self._unk_id]
                break
            start = end
        if len(self._pieces) >= _CACHE_WORDS:
            self._pieces.clear()
        result = self._pieces[word] = tuple(out)
        return result

    @staticmethod
    def _flatten(
        ids: np.ndarray, counts: np.ndarray, rare: tuple[np.ndarray, list[tuple[int, ...]]]
    ) -> np.ndarray:
        """The words' tokens, flat: a rare word's pieces where its one id would be."""
        offsets = np.cumsum(counts) - counts
        flat = np.empty(int(counts.sum()), dtype=np.int64)
        where, pieces = rare
        single = np.ones(counts.size, dtype=bool)
        if where.size:
            single[where] = False
            sizes = counts[where]
            at = np.repeat(offsets[where] - np.cumsum(sizes) + sizes, sizes)
            at += np.arange(at.size)
            flat[at] = np.fromiter(
                itertools.chain.from_iterable(pieces), dtype=np.int64, count=at.size
            )
        flat[offsets[single]] = ids[single]
        return flat

    def _assemble(
        self,
        flat: np.ndarray,
        counts: np.ndarray,
        text_of_word: np.ndarray,
        num_texts: int,
        max_tokens: int | None,
        side: TruncationSide,
        add_special_tokens: bool,
    ) -> list[np.ndarray]:
        own = np.bincount(text_of_word, weights=counts, minlength=num_texts).astype(np.int64)
        own_start = np.cumsum(own) - own
        lead = self._leading if add_special_tokens else self._leading[:0]
        trail = self._trailing if add_special_tokens else self._trailing[:0]
        extra = lead.size + trail.size
        kept = own if max_tokens is None else np.minimum(own, max_tokens - extra)
        skip = own - kept if side == "left" else np.zeros_like(own)
        sizes = kept + extra
        out_start = np.cumsum(sizes) - sizes
        out = np.empty(int(sizes.sum()), dtype=np.int64)
        # Each kept token's place in `flat`: its text's first kept token, then the next ones.
        source = np.repeat(own_start + skip - (np.cumsum(kept) - kept), kept)
        source += np.arange(source.size)
        body = np.repeat(out_start + lead.size - (np.cumsum(kept) - kept), kept)
        body += np.arange(body.size)
        out[body] = flat[source]
        for j, token in enumerate(lead.tolist()):
            out[out_start + j] = token
        for j, token in enumerate(trail.tolist()):
            out[out_start + sizes - trail.size + j] = token
        bounds = [*out_start.tolist(), out.size]
        return [out[a:b] for a, b in itertools.pairwise(bounds)]


def _is_word(entry: str) -> bool:
    """Whether a vocabulary entry can be a whole pre-tokenized word of a plain text: a run of
    letters and digits, or one punctuation character."""
    if len(entry) == 1:
        return 0x21 <= ord(entry) <= 0x7E
    return entry.isalnum()
