"""`ArrayWordPiece` (`vecpool/inputs/wordpiece.py`) gives exactly the ids of the `tokenizers` library
on the real MiniLM tokenizer and on changed copies of it (cased, an added token holding a
space, another template), for random texts of vocabulary words, unknown words, words past the
table's 24 bytes and WordPiece's 100 characters, punctuation and whitespace of every kind, with
and without special tokens and truncation from either side; it declines what it does not
serve; and `TextTokenizer.encode_ids` takes it for large batches only."""

from __future__ import annotations

import json
import random
import string
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from tokenizers import Tokenizer

from tests.helpers import batch_sizes_of
from vecpool.inputs import tokenizer as tokenizer_module
from vecpool.inputs.tokenizer import TextTokenizer
from vecpool.inputs.wordpiece import ArrayWordPiece

PUNCTUATION = string.punctuation
SPACES = (" ", "  ", "\t", "\n", " \r\n ", "")


def _config(default_model_dir: Path) -> dict[str, Any]:
    return json.loads((default_model_dir / "tokenizer.json").read_text())


def _ascii_vocab(config: dict[str, Any]) -> list[str]:
    return [w for w in config["model"]["vocab"] if w.isascii()]


def _no_added(texts: list[str], config: dict[str, Any]) -> list[str]:
    """The texts that hold no added token's text (which the fast path leaves alone)."""
    added = [t["content"].lower() for t in config["added_tokens"]]
    return [t for t in texts if not any(a in t.lower() for a in added)]


def _texts(rng: random.Random, vocab: list[str], n: int) -> list[str]:
    """Texts of whole vocabulary entries (some upper-cased), their pieces glued into unknown
    words, random letters and digits, punctuation runs, long words, and whitespace."""
    out = []
    for _ in range(n):
        parts = []
        for _ in range(rng.randint(0, 40)):
            r = rng.random()
            if r < 0.45:
                parts.append(rng.choice(vocab))
            elif r < 0.6:
                parts.append("".join(rng.choice(vocab).lstrip("#") for _ in range(3)))
            elif r < 0.72:
                alnum = string.ascii_letters + string.digits
                parts.append("".join(rng.choice(alnum) for _ in range(rng.randint(1, 30))))
            elif r < 0.82:
                parts.append("".join(rng.choice(PUNCTUATION) for _ in range(rng.randint(1, 5))))
            elif r < 0.86:
                parts.append(rng.choice("ab") * rng.randint(20, 110))
            else:
                parts.append(rng.choice(vocab).upper() + rng.choice(PUNCTUATION))
        out.append(rng.choice(SPACES).join(parts) or rng.choice(("a", " ", "\t\n")))
    return out


def _reference(path: Path, max_tokens: int | None, side: str) -> Tokenizer:
    tok = Tokenizer.from_file(str(path))
    tok.no_padding()
    if max_tokens is None:
        tok.no_truncation()
    else:
        tok.enable_truncation(max_tokens, direction=side)
    return tok


def _check_exact(path: Path, texts: list[str]) -> int:
    """Every batch equal to the library's ids; the number of texts compared."""
    fast = ArrayWordPiece.build(path.read_text())
    assert fast is not None
    compared = 0
    for max_tokens, side, specials in (
        (None, "right", True),
        (None, "right", False),
        (24, "right", True),
        (24, "left", True),
        (7, "left", False),
        (3, "right", True),
    ):
        reference = _reference(path, max_tokens, side)
        for start in range(0, len(texts), 61):
            batch = texts[start : start + 61]
            ours = fast.encode(batch, max_tokens, side, specials)  # type: ignore[arg-type]
            assert ours is not None
            expected = reference.encode_batch(batch, add_special_tokens=specials)
            for a, e in zip(ours, expected, strict=True):
                if a is not None:
                    assert a.tolist() == e.ids
                    assert a.dtype == np.int64
                    compared += 1
    return compared


def _write(tmp_path: Path, config: dict[str, Any], name: str) -> Path:
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(config))
    return path


def test_the_real_tokenizer_gives_the_same_ids(tmp_path: Path, default_model_dir: Path) -> None:
    config = _config(default_model_dir)
    texts = _no_added(_texts(random.Random(0), _ascii_vocab(config), 1200), config)
    compared = _check_exact(default_model_dir / "tokenizer.json", texts)
    assert compared == 6 * len(texts)  # no batch declined
    fast = ArrayWordPiece.build((default_model_dir / "tokenizer.json").read_text())
    assert fast is not None and fast._probes > 1  # the table's probing was exercised


@pytest.mark.parametrize("change", ["cased", "added_with_space", "prefix_only"])
def test_changed_tokenizers_give_the_same_ids(
    tmp_path: Path, default_model_dir: Path, change: str
) -> None:
    config = _config(default_model_dir)
    if change == "cased":
        config["normalizer"]["lowercase"] = False
    elif change == "added_with_space":
        config["added_tokens"].append(
            {
                "id": len(config["model"]["vocab"]),
                "content": "new york",
                "single_word": False,
                "lstrip": False,
                "rstrip": False,
                "normalized": True,
                "special": False,
            }
        )
    else:  # a template of one leading special token
        config["post_processor"] = {
            "type": "TemplateProcessing",
            "single": [
                {"SpecialToken": {"id": "[CLS]", "type_id": 0}},
                {"Sequence": {"id": "A", "type_id": 0}},
            ],
            "pair": [
                {"Sequence": {"id": "A", "type_id": 0}},
                {"Sequence": {"id": "B", "type_id": 1}},
            ],
            "special_tokens": {"[CLS]": {"id": "[CLS]", "ids": [101], "tokens": ["[CLS]"]}},
        }
    path = _write(tmp_path, config, change)
    texts = _no_added(_texts(random.Random(1), _ascii_vocab(config), 300), config)
    compared = _check_exact(path, texts)
    assert compared == 6 * len(texts)
    if change == "added_with_space":  # the token (in any case, across a break) is declined
        texts = ["in new york today", "in New\tYork", "new  york"]
        fast = ArrayWordPiece.build(path.read_text())
        assert fast is not None
        assert [x is None for x in fast.encode(texts) or ()] == [True, True, False]
        assert _check_exact(path, texts) == 6  # the third, under each of the six settings


# Characters outside ASCII of many kinds: accented and other Latin letters, Greek, Cyrillic,
# typographic punctuation, symbols and box drawing, CJK (which the normalizer spaces out),
# other whitespace, zero-width and format characters (removed), emoji, fullwidth forms.
OTHER = (
    "\u00e9\u00c9\u00fc\u00df\u00e6\u00f8\u00e5\u00f1\u00e7\u0131\u0130\u0141\u00b5"
    "\u03a3\u03c3\u03c2\u03b1\u0416\u0436"
    "\u2019\u2018\u201c\u201d\u2014\u2013\u2026\u2022\u00b7\u00a1\u00bf\u00ab\u00bb"
    "\u00d7\u2192\u2265\u00b1\u20ac\u00a9\u2500\u2502\u2588\u00b2\u2076"
    "\u4e2d\u6587\u3001\u3002\u00a0\u2009\u3000\u200b\u200d\ufeff\u00ad"
    "\U0001f600\u2705\uff21\uff41\ufb01"
)


def _mixed(rng: random.Random, vocab: list[str], n: int) -> list[str]:
    """`_texts`' texts with characters of `OTHER` put in, alone and inside words."""
    out = []
    for text in _texts(rng, vocab, n):
        chars = list(text)
        for _ in range(rng.randint(1, 6)):
            chars.insert(rng.randint(0, len(chars)), rng.choice(OTHER) * rng.randint(1, 2))
        out.append("".join(chars))
    return out


@pytest.mark.parametrize("lowercase", [True, False])
def test_characters_outside_ascii_give_the_same_ids(
    tmp_path: Path, default_model_dir: Path, lowercase: bool
) -> None:
    config = _config(default_model_dir)
    config["normalizer"]["lowercase"] = lowercase
    path = _write(tmp_path, config, f"lowercase_{lowercase}")
    texts = _no_added(_mixed(random.Random(3), _ascii_vocab(config), 400), config)
    assert _check_exact(path, texts) == 6 * len(texts)  # every text served
    fast = ArrayWordPiece.build(path.read_text())
    assert fast is not None
    fast.encode(["".join(OTHER)])
    assert len(fast._normalize) > 40  # the characters were described, not declined


def test_what_it_does_not_serve_is_declined(tmp_path: Path, default_model_dir: Path) -> None:
    fast = ArrayWordPiece.build((default_model_dir / "tokenizer.json").read_text())
    assert fast is not None
    reference = _reference(default_model_dir / "tokenizer.json", None, "right")
    expected = reference.encode("hello world").ids
    for text in (
        "a\x00b",  # the separator within a text
        "a\x0bb",  # an ASCII control character
        "e\u0301",  # a combining mark
        "a\ud800b",  # a lone surrogate
        "a [CLS] b",  # an added token's text
        "a [mask] b",  # in any case
        "",
    ):
        # That text alone is declined; the others of its batch are served.
        out = fast.encode(["hello world", text, "hello world"])
        assert out is not None and out[1] is None, text
        assert [x.tolist() for x in (out[0], out[2])] == [expected, expected]  # type: ignore[union-attr]
        assert fast.encode([text]) == [None]
    assert fast.encode([]) is None
    assert fast.encode(["a", ("b", "c")]) is None  # type: ignore[list-item]
    assert fast.encode(["a"], max_tokens=2) is None  # no room besides the special tokens


@pytest.mark.parametrize("part", ["normalizer", "pre_tokenizer", "model"])
def test_other_tokenizers_are_not_served(
    tmp_path: Path, default_model_dir: Path, part: str
) -> None:
    config = _config(default_model_dir)
    config[part] = {
        "normalizer": {"type": "Lowercase"},
        "pre_tokenizer": {"type": "Whitespace"},
        "model": {"type": "WordLevel", "vocab": config["model"]["vocab"], "unk_token": "[UNK]"},
    }[part]
    assert ArrayWordPiece.build(json.dumps(config)) is None


def test_every_vocabulary_word_is_found(default_model_dir: Path) -> None:
    """Each whole word of the table, alone, is its own id (found, not taken apart)."""
    config = _config(default_model_dir)
    fast = ArrayWordPiece.build(json.dumps(config))
    assert fast is not None
    vocab = config["model"]["vocab"]
    words = [w for w in vocab if w.isascii() and w.isalnum() and w == w.lower() and len(w) <= 24]
    ids = fast.encode(words, add_special_tokens=False)
    assert ids is not None
    assert [a.tolist() for a in ids] == [[vocab[w]] for w in words]  # type: ignore[union-attr]


def test_encode_ids_takes_the_fast_path_for_large_batches_only(
    default_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ours = TextTokenizer(default_model_dir / "tokenizer.json")
    calls = batch_sizes_of(monkeypatch, ArrayWordPiece, "encode")
    config = _config(default_model_dir)
    texts = _no_added(_texts(random.Random(2), _ascii_vocab(config), 64), config)
    small = texts[:2]
    assert sum(map(len, small)) < tokenizer_module.WORDPIECE_MIN_CHARS
    assert sum(map(len, texts)) >= tokenizer_module.WORDPIECE_MIN_CHARS
    for batch, taken in ((small, []), (texts, [len(texts)])):
        calls.clear()
        ids = ours.encode_ids(batch, 20, "left")
        assert calls == taken
        expected = ours.encode_batch(batch, 20, "left", offsets=False)
        assert [a.tolist() for a in ids] == [e.ids for e in expected]


def _check_pairs_exact(path: Path, pairs: list[tuple[str, str]]) -> int:
    """Every batch of pairs equal to the library's ids and segment ids; the number of pairs
    compared."""
    fast = ArrayWordPiece.build(path.read_text())
    assert fast is not None
    compared = 0
    # Room for both texts whole, one cut, or both cut to halves (odd and even), either side.
    for max_tokens, side in (
        (None, "right"),
        (64, "right"),
        (24, "left"),
        (9, "left"),
        (8, "right"),
        (5, "right"),
    ):
        reference = _reference(path, max_tokens, side)
        for start in range(0, len(pairs), 61):
            batch = pairs[start : start + 61]
            ours = fast.encode_pairs(batch, max_tokens, side)  # type: ignore[arg-type]
            assert ours is not None
            for a, e in zip(ours, reference.encode_batch(batch), strict=True):
                if a is not None:
                    assert a[0].tolist() == e.ids
                    assert a[1].tolist() == e.type_ids
                    assert a[0].dtype == a[1].dtype == np.int64
                    compared += 1
    return compared


def _pairs(texts: list[str]) -> list[tuple[str, str]]:
    return list(zip(texts[0::2], texts[1::2], strict=True))


@pytest.mark.parametrize("change", [None, "cased", "prefix_only", "outside_ascii"])
def test_text_pairs_give_the_same_ids_and_segments(
    tmp_path: Path, default_model_dir: Path, change: str | None
) -> None:
    """Pairs of texts of 0 to 40 parts (some of no tokens at all), through the pair template
    and the longest-first truncation."""
    config = _config(default_model_dir)
    if change == "cased":
        config["normalizer"]["lowercase"] = False
    elif change == "prefix_only":  # a pair template of no special tokens: A then B
        config["post_processor"] = {
            "type": "TemplateProcessing",
            "single": [{"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [
                {"Sequence": {"id": "A", "type_id": 0}},
                {"Sequence": {"id": "B", "type_id": 1}},
            ],
            "special_tokens": {},
        }
    make = _mixed if change == "outside_ascii" else _texts
    texts = _no_added(make(random.Random(4), _ascii_vocab(config), 100), config)
    pairs = _pairs(texts[: len(texts) // 2 * 2])
    path = _write(tmp_path, config, str(change))
    assert _check_pairs_exact(path, pairs) == 6 * len(pairs)  # every pair served


def test_pairs_it_does_not_serve_are_declined(default_model_dir: Path) -> None:
    path = default_model_dir / "tokenizer.json"
    fast = ArrayWordPiece.build(path.read_text())
    assert fast is not None
    expected = _reference(path, None, "right").encode("hello", "big world")
    for bad in ("a\x0bb", "a [SEP] b", ""):
        for pair in ((bad, "x"), ("x", bad)):
            # That pair alone is declined; the others of its batch are served.
            out = fast.encode_pairs([("hello", "big world"), pair, ("hello", "big world")])
            assert out is not None and out[1] is None, pair
            for row in (out[0], out[2]):
                assert row is not None
                assert (row[0].tolist(), row[1].tolist()) == (expected.ids, expected.type_ids)
    assert fast.encode_pairs([]) is None
    assert fast.encode_pairs(["a b"]) is None  # type: ignore[list-item]
    assert fast.encode_pairs([("a", "b")], max_tokens=4) is None  # no room for both texts


def test_encode_pair_ids_fills_in_what_the_fast_path_declines(
    default_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ours = TextTokenizer(default_model_dir / "tokenizer.json")
    calls = batch_sizes_of(monkeypatch, ArrayWordPiece, "encode_pairs")
    config = _config(default_model_dir)
    pairs = _pairs(_no_added(_texts(random.Random(5), _ascii_vocab(config), 80), config)[:64])
    pairs[3] = ("a\x0bcontrol character", pairs[3][1])  # left to the library
    small = pairs[:1]
    for batch, taken in ((small, []), (pairs, [len(pairs)])):
        calls.clear()
        ids, type_ids = ours.encode_pair_ids(batch, 20, "left")
        assert calls == taken
        expected = ours.encode_batch(batch, 20, "left", offsets=False)
        assert [a.tolist() for a in ids] == [e.ids for e in expected]
        assert [a.tolist() for a in type_ids] == [e.type_ids for e in expected]
    assert ours.encode_pair_ids([], 20, "left") == ([], [])
