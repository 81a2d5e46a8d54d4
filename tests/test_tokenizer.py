"""The cheaper tokenizer copy for plain texts (`vecpool.inputs.tokenizer`) gives exactly what the
tokenizer file gives: the same ids and type ids for random texts, pairs and truncations, with
and without the characters that send a text to the full tokenizer (controls, accents, CJK),
on the real MiniLM tokenizer and on a cased copy of it."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from vecpool.inputs.tokenizer import TextTokenizer, _plain_twin

PLAIN = (
    "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"
    + " " * 12
    + ".,;:!?'\"()[]-_/#@&*+=<>%$^~`|{}\\"
)
OTHER = "\t\n\r\x0b\x0c\x00\x01\x1f\x7f\u00e9\u00c9\u00fc\u00df\u4e2d\u6587\u3000\u00a0\u200b\ufffd\U0001f600"


def _texts(rng: random.Random, n: int, other: float) -> list[str]:
    words = []
    for _ in range(n):
        length = rng.randint(0, 60)
        pool = PLAIN + (OTHER if rng.random() < other else "")
        words.append("".join(rng.choice(pool) for _ in range(length)))
    return words


def _folder(tmp_path: Path, default_model_dir: Path, lowercase: bool) -> Path:
    config = json.loads((default_model_dir / "tokenizer.json").read_text())
    config["normalizer"]["lowercase"] = lowercase
    path = tmp_path / f"tokenizer_{lowercase}.json"
    path.write_text(json.dumps(config))
    return path


@pytest.mark.parametrize("lowercase", [True, False])
def test_plain_texts_tokenize_as_the_file_does(
    tmp_path: Path, default_model_dir: Path, lowercase: bool
) -> None:
    path = _folder(tmp_path, default_model_dir, lowercase)
    ours = TextTokenizer(path)
    assert ours._plain_json is not None
    reference = Tokenizer.from_file(str(path))
    reference.no_padding()
    reference.no_truncation()
    rng = random.Random(0)
    texts = [*_texts(rng, 400, other=0.3), "[CLS] Hello\tWORLD\r\n[SEP]", "", "   ", "A\x0bB"]
    plain = [ours._is_plain(t) for t in texts]
    assert 100 < sum(plain) < len(texts)  # both paths taken
    pairs = list(zip(texts[::2], texts[1::2], strict=True))
    for batch in (texts, pairs, [t for t, p in zip(texts, plain, strict=True) if p]):
        for max_tokens, side in ((None, "right"), (12, "right"), (9, "left")):
            if max_tokens is None:
                reference.no_truncation()
            else:
                reference.enable_truncation(max_tokens, direction=side)
            expected = reference.encode_batch(batch)
            got = ours.encode_batch(batch, max_tokens, side, offsets=False)
            assert [e.ids for e in got] == [e.ids for e in expected]
            assert [e.type_ids for e in got] == [e.type_ids for e in expected]


def test_only_a_bert_normalizer_gets_a_plain_copy(default_model_dir: Path) -> None:
    config = json.loads((default_model_dir / "tokenizer.json").read_text())
    twin = _plain_twin(config)
    assert twin is not None
    assert twin[0]["normalizer"] == {"type": "Lowercase"} and twin[1]
    assert _plain_twin({**config, "normalizer": {"type": "NFC"}}) is None
    assert _plain_twin({**config, "normalizer": None}) is None
    # Breaks stay with the full tokenizer under another pre-tokenizer, or when an added token
    # matched on normalized text holds whitespace.
    assert _plain_twin({**config, "pre_tokenizer": {"type": "Whitespace"}})[1] is False  # type: ignore[index]
    spaced = {"content": "new york", "normalized": True, "id": 30522, "special": False}
    added = {**config, "added_tokens": [*config["added_tokens"], spaced]}
    assert _plain_twin(added)[1] is False  # type: ignore[index]
