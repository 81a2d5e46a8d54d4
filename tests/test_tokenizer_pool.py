"""The tokenizer's child processes give the ids the calling process would (the same code on the
same file, a batch split among them in order), and whatever goes wrong with them (a bad text, a
dead child, a closed pool) leaves the batch to the calling process, which tokenizes it or
raises the error that names the input."""

from __future__ import annotations

import argparse
import os
import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import vecpool
from tests.test_inputs_batch import limits
from vecpool.api.args import EngineArgs
from vecpool.api.running import PIPELINE_CHUNK, PIPELINE_FIRST_CHUNK
from vecpool.errors import InputError
from vecpool.inputs.prompts import InputProcessor, TextOptions, TextTokenizer
from vecpool.inputs.tokenizer_pool import PROCESS_MIN_CHARS, TokenizerPool, default_size

WORDS = "the quick brown fox jumps over lazy dog Ünïcödé naïve café 東京 🙂 tab\there".split(" ")


def texts(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choices(WORDS, k=rng.randint(1, 40))) for _ in range(n)]


def started(size: int, tokenizer_file: Path) -> TokenizerPool:
    pool = TokenizerPool(tokenizer_file, size)
    pool.start()
    assert pool.wait_ready(60), "the tokenizer processes did not start within 60 s"
    return pool


@pytest.fixture
def tokenizer_file(default_model_dir: Path) -> Path:
    return default_model_dir / "tokenizer.json"


@pytest.mark.parametrize("size", [1, 3])
def test_children_give_the_calling_process_ids(tokenizer_file: Path, size: int) -> None:
    ours = TextTokenizer(tokenizer_file)
    pool = started(size, tokenizer_file)
    try:
        # Texts of very different lengths, so that the parts differ in how many texts they hold.
        batch = [*texts(300), " ".join(texts(40, seed=9)), *texts(5, seed=4)]
        assert sum(map(len, batch)) >= size * PROCESS_MIN_CHARS
        for max_tokens, side, specials in [
            (None, "right", True),
            (7, "left", True),
            (5, "right", False),
        ]:
            got = pool.encode_ids(batch, max_tokens, side, specials)
            want = ours.encode_ids(batch, max_tokens, side, specials)
            assert got is not None and len(got) == len(want) == len(batch)
            for a, b in zip(got, want, strict=True):
                assert a.dtype == b.dtype == np.int64
                np.testing.assert_array_equal(a, b)
        # A small batch is not worth the round trip: the caller tokenizes it.
        assert pool.encode_ids(batch[:3], None, "right", True) is None
    finally:
        pool.close()


def test_the_first_large_batch_starts_the_children(tokenizer_file: Path) -> None:
    pool = TokenizerPool(tokenizer_file, 1)
    try:
        batch = texts(300)
        assert not pool.children
        assert pool.encode_ids(batch, None, "right", True) is None  # tokenized by the caller
        assert len(pool.children) == 1
        assert pool.wait_ready(60)
        assert pool.encode_ids(batch, None, "right", True) is not None
    finally:
        pool.close()


def test_a_bad_text_is_named_by_the_calling_process(tokenizer_file: Path) -> None:
    pool = started(2, tokenizer_file)
    try:
        batch = texts(300)
        bad = [*batch[:123], "a lone \ud800 surrogate", *batch[123:]]
        assert pool.encode_ids(bad, None, "right", True) is None
        processor = InputProcessor(limits(512), TextTokenizer(tokenizer_file), tokenizer_pool=pool)
        with pytest.raises(InputError, match="not valid Unicode") as err:
            processor.process(bad, TextOptions())
        assert err.value.index == 123
        # The children are still in use after declining a batch.
        assert pool.encode_ids(batch, None, "right", True) is not None
    finally:
        pool.close()


def test_a_dead_child_leaves_batches_to_the_caller(tokenizer_file: Path) -> None:
    pool = started(2, tokenizer_file)
    tokenizer = TextTokenizer(tokenizer_file)
    processor = InputProcessor(limits(512), tokenizer, tokenizer_pool=pool)
    plain = InputProcessor(limits(512), tokenizer)
    batch = texts(300, seed=1)
    pool.children[1].proc.kill()
    pool.children[1].proc.wait()
    assert pool.encode_ids(batch, None, "right", True) is None  # no exception
    assert pool.children[0].proc.wait(10) is not None  # the other one stopped too
    assert pool.encode_ids(batch, None, "right", True) is None  # and none is used again
    got = processor.process(batch, TextOptions())
    want = plain.process(batch, TextOptions())
    for a, b in zip(got, want, strict=True):
        np.testing.assert_array_equal(a.token_ids, b.token_ids)


def test_close_stops_the_children(tokenizer_file: Path) -> None:
    pool = started(2, tokenizer_file)
    assert all(child.proc.poll() is None for child in pool.children)
    # Out of the caller's session: a terminal's Ctrl-C does not reach them.
    assert all(os.getsid(child.proc.pid) != os.getsid(0) for child in pool.children)
    pool.close()
    assert all(child.proc.poll() is not None for child in pool.children)
    assert pool.encode_ids(texts(300), None, "right", True) is None


def test_engine_tokenizes_large_calls_in_its_children(minilm: vecpool.Engine) -> None:
    """The engine's large calls of texts go to its tokenizer processes once they have started:
    the same ids as the same call from token ids. (The outputs are compared within float32
    rounding: a chunk joins the steps when it is ready, so the steps' makeup may differ.)"""
    pool = minilm.inputs.tokenizer_pool
    assert pool is not None
    pool.start()
    assert pool.wait_ready(60)
    # Over PIPELINE_CHUNK texts: run in two chunks (128, 392), each over PROCESS_MIN_CHARS.
    batch = texts(520, seed=3)
    assert (
        len(batch) > PIPELINE_CHUNK
        and sum(map(len, batch[:PIPELINE_FIRST_CHUNK])) > PROCESS_MIN_CHARS
    )
    ids = [p.token_ids for p in minilm.inputs.process(batch, TextOptions())]
    sent = []
    original = pool.encode_ids

    def spy(*args: Any) -> list[np.ndarray] | None:
        out = original(*args)
        sent.append(out is not None)
        return out

    pool.encode_ids = spy  # type: ignore[method-assign]
    try:
        from_text = minilm.embed(batch, show_progress=False)
    finally:
        del pool.encode_ids
    assert any(sent), "no batch of the call went to the children"
    from_ids = minilm.embed([a.tolist() for a in ids], show_progress=False)
    np.testing.assert_allclose(from_text, from_ids, rtol=0, atol=1e-5)


def test_the_engine_option_sets_the_pools_size(default_model_dir: Path) -> None:
    assert (
        vecpool.Engine(default_model_dir, device="cpu", tokenizer_processes=0).inputs.tokenizer_pool
        is None
    )
    engine = vecpool.Engine(default_model_dir, device="cpu", tokenizer_processes=3)
    pool = engine.inputs.tokenizer_pool
    assert pool is not None and pool.size == 3 and not pool.children  # started by a large batch
    default = vecpool.Engine(default_model_dir, device="cpu").inputs.tokenizer_pool
    assert default is not None and default.size == default_size()
    with pytest.raises(vecpool.ConfigError, match="tokenizer_processes must be 0 or positive"):
        vecpool.Engine(default_model_dir, device="cpu", tokenizer_processes=-1)
    args = argparse.ArgumentParser()
    EngineArgs.add_cli_args(args)
    assert (
        EngineArgs.from_cli_args(
            args.parse_args(["--tokenizer-processes", "0"])
        ).tokenizer_processes
        == 0
    )


@pytest.mark.parametrize(("cores", "size"), [(1, 1), (2, 1), (7, 1), (8, 2), (16, 4), (64, 4)])
def test_the_default_size_is_a_core_in_four(
    monkeypatch: pytest.MonkeyPatch, cores: int, size: int
) -> None:
    """Counted over the cores this process may run on, not the host's."""
    monkeypatch.setattr(os, "cpu_count", lambda: 128)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cores)), raising=False)
    assert default_size() == size


def test_a_fork_neither_uses_nor_stops_its_parents_children(tokenizer_file: Path) -> None:
    """A forked process (a `multiprocessing` worker of the fork start) shares the children's
    sockets: it tokenizes itself, and closing its copy of the pool leaves them to the parent."""
    pool = started(1, tokenizer_file)
    try:
        batch = texts(300, seed=8)
        pid = os.fork()
        if pid == 0:  # the fork: exit status 0 when all held
            declined = pool.encode_ids(batch, None, "right", True) is None
            pool.close()
            os._exit(0 if declined else 1)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert all(child.proc.poll() is None for child in pool.children)
        assert pool.encode_ids(batch, None, "right", True) is not None
    finally:
        pool.close()
