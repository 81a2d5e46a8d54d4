"""The real default model (all-MiniLM-L6-v2) against sentence-transformers."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from sentence_transformers import SentenceTransformer

import vecpool

SENTENCES = [
    "A man is eating food.",
    "A man is eating a piece of bread.",
    "The girl is carrying a baby.",
    "A man is riding a horse.",
    "A woman is playing violin.",
    "Two men pushed carts through the woods.",
    "A man is riding a white horse on an enclosed ground.",
    "A monkey is playing drums.",
]


@pytest.fixture(scope="module")
def st_model(default_model_dir: Path) -> SentenceTransformer:
    return SentenceTransformer(str(default_model_dir), device="cpu")


def test_embed_matches_sentence_transformers(minilm: vecpool.Engine, st_model) -> None:
    ours = minilm.embed(SENTENCES)
    ref = st_model.encode(SENTENCES, convert_to_numpy=True)
    assert ours.shape == (len(SENTENCES), 384)
    assert ours.dtype == np.float32
    assert np.abs(ours - ref).max() < 1e-5
    np.testing.assert_allclose(np.linalg.norm(ours, axis=1), 1.0, atol=1e-6)


def test_paraphrases_are_closer_than_unrelated(minilm: vecpool.Engine) -> None:
    v = minilm.embed(
        [
            "How do I bake sourdough bread at home?",
            "What is the way to make sourdough bread in my kitchen?",
            "The stock market fell sharply on Tuesday.",
        ]
    )
    sim = v @ v.T
    assert sim[0, 1] > 0.7
    assert sim[0, 1] > sim[0, 2] + 0.4


def test_long_text_truncation_matches_sentence_transformers(
    minilm: vecpool.Engine, st_model
) -> None:
    # sentence-transformers truncates at max_seq_length (256); so do we when asked to.
    long_text = " ".join(["the quick brown fox jumps over the lazy dog"] * 60)
    with pytest.raises(
        vecpool.InputError,
        match=r"input 1: .*more than the model's maximum context length of 256 tokens",
    ):
        minilm.embed(["short", long_text])
    assert len(minilm.tokenize(long_text)) == 542  # tokenize counts past the limit
    ours = minilm.embed([long_text], truncate_prompt_tokens=-1)
    ref = st_model.encode([long_text])
    assert np.abs(ours - ref).max() < 1e-5


def test_mixed_text_ids_and_embeds_are_bit_exact(minilm: vecpool.Engine) -> None:
    ids = [minilm.tokenize(s) for s in SENTENCES[:4]]
    as_text = minilm.embed(SENTENCES[:4])
    as_ids = minilm.embed(ids)
    mixed = minilm.embed(
        [
            SENTENCES[0],
            ids[1],
            {"prompt_embeds": minilm.embed_tokens(ids[2])},
            {"prompt_token_ids": ids[3]},
        ]
    )
    all_embeds = minilm.embed([{"prompt_embeds": minilm.embed_tokens(i)} for i in ids])
    # By construction: the same tokens in the same order, each row either the ids' lookup or
    # prompt embeds that are that lookup, so every call is the same computation.
    assert np.array_equal(as_text, as_ids)
    assert np.array_equal(as_text, mixed)
    assert np.array_equal(as_text, all_embeds)


def test_dimensions_truncate_then_renormalize(minilm: vecpool.Engine) -> None:
    full = minilm.embed(SENTENCES[:3], normalize=False)
    short = minilm.embed(SENTENCES[:3], dimensions=64)
    assert short.shape == (3, 64)
    expected = full[:, :64] / np.linalg.norm(full[:, :64], axis=1, keepdims=True)
    assert np.abs(short - expected).max() < 1e-6
    raw = minilm.embed(SENTENCES[:3], dimensions=64, normalize=False)
    # The same batch, and truncation only zeroes the columns past 64: the same bits.
    assert np.abs(raw - full[:, :64]).max() == 0.0


def test_a_large_batch_of_texts_is_bit_exact_with_its_ids(
    minilm: vecpool.Engine, default_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A batch large enough for `vecpool.inputs.wordpiece`'s array path (texts outside ASCII and
    one with an added token's text among them, which goes to the library) embeds as its ids
    from the `tokenizers` library do."""
    from tokenizers import Tokenizer

    from vecpool.inputs import tokenizer as tokenizer_module
    from vecpool.inputs.wordpiece import ArrayWordPiece

    texts = [
        f"{s} Caf\u00e9 \u201cnumber\u201d {i}: r\u00e9sum\u00e9s \u2014 \u4e2d\u6587 {s.upper()}"
        for i, s in enumerate(SENTENCES * 3)
    ] + ["a [SEP] inside", *SENTENCES]
    assert sum(map(len, texts)) >= tokenizer_module.WORDPIECE_MIN_CHARS
    served: list[int] = []
    encode = ArrayWordPiece.encode

    def counted(self: ArrayWordPiece, batch: list[str], *args: object) -> object:
        out = encode(self, batch, *args)  # type: ignore[arg-type]
        served.append(sum(x is not None for x in out or ()))
        return out

    monkeypatch.setattr(ArrayWordPiece, "encode", counted)
    library = Tokenizer.from_file(str(default_model_dir / "tokenizer.json"))
    library.no_padding()
    library.no_truncation()
    ids = [e.ids for e in library.encode_batch(texts)]
    as_text = minilm.embed(texts)
    assert served == [len(texts) - 1]  # all but the one with "[SEP]"
    # The same tokens in the same order, so the same computation (as above).
    assert np.array_equal(as_text, minilm.embed(ids))
