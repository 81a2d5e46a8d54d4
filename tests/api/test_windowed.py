"""Windowed embedding: an input longer than the model's limit becomes the token-weighted mean of
the embeddings of overlapping windows, computed here directly from the documented definition
(`vecpool.calls.windowed`) and compared.

Tolerance: 1e-6 absolute on unit vectors (the windows run in one batch with the call's other
inputs there and in another batch here: float32 rounding of the padded fallback).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

import vecpool
from tests.conftest import make_st_folder
from vecpool.calls.windowed import combine_windows

LIMIT = 64  # the folder's max_seq_length


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path) -> vecpool.Engine:
    folder = make_st_folder(
        tmp_path_factory.mktemp("windowed"),
        default_model_dir,
        pooling="pooling_mode_mean_tokens",
        dense_out=24,
        normalize=True,
    )
    return vecpool.Engine(folder, device="cpu")


def _long_text(engine: vecpool.Engine) -> tuple[str, list[int]]:
    words = "river stone cloud amber signal harbor quiet lantern meadow copper".split()
    text = " ".join(words[i % len(words)] + ("s" if i % 3 else "") for i in range(200))
    ids = engine.tokenize(text)
    assert 3 * LIMIT <= len(ids) <= 4 * LIMIT  # three times the model's length, and more
    return text, ids


def _windows(body: list, size: int, overlap: int) -> list[tuple[int, int]]:
    """The documented slices: `size` tokens each, each starting `size - overlap` after the one
    before, until one reaches the end."""
    starts = [0]
    while starts[-1] + size < len(body):
        starts.append(starts[-1] + size - overlap)
    return [(s, min(s + size, len(body))) for s in starts]


def test_windowed_text_is_the_documented_combination(engine: vecpool.Engine) -> None:
    text, ids = _long_text(engine)
    with pytest.raises(vecpool.InputError, match=r"input 0: the input has \d+ tokens, more than"):
        engine.embed([text])
    short = "a short input"
    got = engine.embed([text, short], windowed=True)
    assert got.shape == (2, 24)
    # Windows of 64 tokens: [CLS], 62 of the text's own tokens, [SEP]; an eighth (8) shared.
    cls, body, sep = ids[0], ids[1:-1], ids[-1]
    slices = _windows(body, LIMIT - 2, LIMIT // 8)
    assert len(slices) >= 4
    windows = [[cls, *body[s:e], sep] for s, e in slices]
    vectors = engine.embed(windows, normalize=False)
    weights = np.array([e - s for s, e in slices], dtype=np.float64)
    mean = (weights[:, None] * vectors).sum(axis=0) / weights.sum()
    assert np.abs(got[0] - mean / np.linalg.norm(mean)).max() <= 1e-6
    # An input within the limit is embedded as usual.
    assert np.abs(got[1] - engine.embed([short])[0]).max() <= 1e-6
    # `dimensions`: the combination truncated, then normalized.
    (truncated,) = engine.embed([text], windowed=True, dimensions=8)
    assert np.abs(truncated - mean[:8] / np.linalg.norm(mean[:8])).max() <= 1e-6
    (raw,) = engine.embed([text], windowed=True, normalize=False)
    assert np.abs(raw - mean).max() <= 1e-6 * np.abs(mean).max()
    # Only true or false switches it (a string was read as true, as HTTP refuses it).
    for bad in ("yes", 1, "false"):
        with pytest.raises(vecpool.InputError, match="windowed: must be true or false"):
            engine.embed([short], windowed=bad)  # type: ignore[arg-type]


def test_windowed_prompt_embeds_and_engine_default(tmp_path: Path, engine: vecpool.Engine) -> None:
    """Token ids and prompt embeds are windowed as given (nothing is added); an engine built with
    `windowed_embed=True` windows by default, with its own overlap."""
    _, ids = _long_text(engine)
    windowed = vecpool.Engine(
        engine.folder.path, device="cpu", windowed_embed=True, embed_window_overlap=0
    )
    slices = _windows(ids, LIMIT, 0)
    vectors = windowed.embed([ids[s:e] for s, e in slices], normalize=False)
    expected = combine_windows(vectors, np.array([e - s for s, e in slices]), None, True)
    rows = [windowed.embed_tokens(ids[i : i + LIMIT]) for i in range(0, len(ids), LIMIT)]
    embeds = {"prompt_embeds": torch.cat(rows)}  # the model's own lookup, a limit at a time
    as_ids, as_embeds = windowed.embed([ids, embeds])
    assert np.abs(as_ids - expected).max() <= 1e-6
    assert np.array_equal(as_ids, as_embeds)
    with pytest.raises(vecpool.InputError, match="maximum context length"):
        windowed.embed([ids], windowed=False)
    # Truncation asked for wins over windows.
    (cut,) = windowed.embed([ids], truncate_prompt_tokens=-1)
    assert np.array_equal(cut, windowed.embed([ids[:LIMIT]])[0])


def test_combine_windows_weights_by_tokens() -> None:
    vectors = np.array([[1.0, 0.0, 3.0], [0.0, 2.0, 0.0]], dtype=np.float32)
    got = combine_windows(vectors, np.array([3, 1]), None, False)
    assert np.allclose(got, [0.75, 0.5, 2.25])
    got = combine_windows(vectors, np.array([3, 1]), 2, True)
    assert np.allclose(got, np.array([0.75, 0.5]) / np.hypot(0.75, 0.5))
