"""The tokenizer's child process gives the ids the calling process would (the same code on the
same file), and whatever goes wrong with it (a bad text, a dead child, a closed one) leaves the
batch to the calling process, which tokenizes it or raises the error that names the input."""

from __future__ import annotations

import random
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import vecpool
from tests.test_inputs_batch import limits
from vecpool.errors import InputError
from vecpool.inputs import InputProcessor, TextOptions, TextTokenizer
from vecpool.tokenizer_process import PROCESS_MIN_CHARS, TokenizerProcess

WORDS = "the quick brown fox jumps over lazy dog Ünïcödé naïve café 東京 🙂 tab\there".split(" ")


def texts(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choices(WORDS, k=rng.randint(1, 40))) for _ in range(n)]


def ready(process: TokenizerProcess, batch: list[str]) -> list[np.ndarray]:
    """The child's ids of `batch`, once it has started (the first batches it declines)."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        out = process.encode_ids(batch, None, "right", True)
        if out is not None:
            return out
        time.sleep(0.02)
    raise AssertionError("the tokenizer process did not start within 60 s")


@pytest.fixture
def tokenizer_file(default_model_dir: Path) -> Path:
    return default_model_dir / "tokenizer.json"


def test_child_ids_equal_the_calling_process(tokenizer_file: Path) -> None:
    ours = TextTokenizer(tokenizer_file)
    process = TokenizerProcess(tokenizer_file)
    try:
        batch = texts(300)
        assert sum(map(len, batch)) >= PROCESS_MIN_CHARS
        assert process.encode_ids(batch, None, "right", True) is None  # it starts meanwhile
        ready(process, batch)
        for max_tokens, side, specials in [
            (None, "right", True),
            (7, "left", True),
            (5, "right", False),
        ]:
            got = process.encode_ids(batch, max_tokens, side, specials)
            want = ours.encode_ids(batch, max_tokens, side, specials)
            assert got is not None and len(got) == len(want) == len(batch)
            for a, b in zip(got, want, strict=True):
                assert a.dtype == b.dtype == np.int64
                np.testing.assert_array_equal(a, b)
        # A small batch is not worth the round trip: the caller tokenizes it.
        assert process.encode_ids(batch[:3], None, "right", True) is None
    finally:
        process.close()


def test_a_bad_text_is_named_by_the_calling_process(tokenizer_file: Path) -> None:
    process = TokenizerProcess(tokenizer_file)
    try:
        batch = texts(300)
        ready(process, batch)
        bad = [*batch[:123], "a lone \ud800 surrogate", *batch[123:]]
        assert process.encode_ids(bad, None, "right", True) is None
        processor = InputProcessor(
            limits(512), TextTokenizer(tokenizer_file), tokenizer_process=process
        )
        with pytest.raises(InputError, match="not valid Unicode") as err:
            processor.process(bad, TextOptions())
        assert err.value.index == 123
        # The child is still in use after declining a batch.
        assert process.encode_ids(batch, None, "right", True) is not None
    finally:
        process.close()


def test_a_dead_child_leaves_batches_to_the_caller(tokenizer_file: Path) -> None:
    process = TokenizerProcess(tokenizer_file)
    tokenizer = TextTokenizer(tokenizer_file)
    processor = InputProcessor(limits(512), tokenizer, tokenizer_process=process)
    plain = InputProcessor(limits(512), tokenizer)
    batch = texts(300, seed=1)
    ready(process, batch)
    child = process.child
    assert child is not None
    child.kill()
    child.wait()
    assert process.encode_ids(batch, None, "right", True) is None  # no exception
    assert process.encode_ids(batch, None, "right", True) is None  # and not used again
    got = processor.process(batch, TextOptions())
    want = plain.process(batch, TextOptions())
    for a, b in zip(got, want, strict=True):
        np.testing.assert_array_equal(a.token_ids, b.token_ids)


def test_close_stops_the_child(tokenizer_file: Path) -> None:
    process = TokenizerProcess(tokenizer_file)
    batch = texts(300, seed=2)
    ready(process, batch)
    child = process.child
    assert child is not None
    assert child.poll() is None
    process.close()
    assert child.poll() is not None
    assert process.encode_ids(batch, None, "right", True) is None


def test_engine_tokenizes_large_calls_in_its_child(minilm: vecpool.Engine) -> None:
    """The engine's large calls of texts go to its tokenizer process once it has started: the
    same ids as the same call from token ids. (The outputs are compared within float32 rounding:
    a chunk joins the steps when it is ready, so the steps' makeup may differ between calls.)"""
    process = minilm.inputs.tokenizer_process
    assert process is not None
    batch = texts(700, seed=3)
    ids = [p.token_ids for p in minilm.inputs.process(batch, TextOptions())]
    sent = []
    original = process.encode_ids

    def spy(*args: Any) -> list[np.ndarray] | None:
        out = original(*args)
        sent.append(out is not None)
        return out

    process.encode_ids = spy  # type: ignore[method-assign]
    try:
        ready(process, batch)
        sent.clear()
        from_text = minilm.embed(batch, show_progress=False)
    finally:
        del process.encode_ids
    assert any(sent), "no batch of the call went to the child"
    from_ids = minilm.embed([a.tolist() for a in ids], show_progress=False)
    np.testing.assert_allclose(from_text, from_ids, rtol=0, atol=1e-5)
