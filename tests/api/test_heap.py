"""An engine keeps its objects out of the collector's full passes (`vecpool.api.heap`): frozen
once built and after a call that compiled, and still freed with the engine when dropped."""

from __future__ import annotations

import asyncio
import gc
import time
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import transformers

import vecpool
from benchmarks.lab.bench_engine_loop import one_round as serve_single_queries
from tests.helpers import save_hf_model
from tests.tasks.conftest import tiny_bert_head, with_minilm_tokenizer
from vecpool.api import heap
from vecpool.api.async_engine import AsyncEngine
from vecpool.runner.compiled import compile_blocks
from vecpool.tasks import PoolingParams


class _Marker:
    """An object the collector tracks (a plain instance with a `__dict__`)."""


def _frozen(obj: object) -> bool:
    """Whether `obj` sits in the permanent generation: tracked, yet in no generation."""
    assert gc.is_tracked(obj)
    return not any(o is obj for o in gc.get_objects())


@pytest.fixture
def fresh_heap(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The module as in a process that never froze; everything unfrozen after the test."""
    monkeypatch.setattr(heap, "_frames_at_freeze", None)
    monkeypatch.setattr(heap, "FREEZE", True)
    gc.unfreeze()
    yield
    gc.unfreeze()


def test_engine_freezes_what_start_up_made(fresh_heap: None, tiny_bert: tuple[Path, Any]) -> None:
    engine = vecpool.Engine(tiny_bert[0], device="cpu")
    assert _frozen(engine.model)
    assert _frozen(engine.core.scheduler)
    later = _Marker()
    engine.embed([[1, 2, 3]], show_progress=False)  # nothing compiled: nothing frozen
    assert not _frozen(later)


def test_a_call_that_compiled_freezes(fresh_heap: None, tiny_bert: tuple[Path, Any]) -> None:
    engine = vecpool.Engine(tiny_bert[0], device="cpu")
    compile_blocks(engine.model, backend="eager")  # compiled by the next forward
    before = _Marker()
    out = engine.embed([[1, 2, 3], [4, 5]], show_progress=False)
    assert _frozen(before)
    after = _Marker()
    again = engine.embed([[1, 2, 3], [4, 5]], show_progress=False)  # the same graph
    assert not _frozen(after)
    assert np.array_equal(out, again)


def test_an_async_engine_step_that_compiled_freezes(
    fresh_heap: None, tiny_bert: tuple[Path, Any]
) -> None:
    engine = vecpool.Engine(tiny_bert[0], device="cpu")
    compile_blocks(engine.model, backend="eager")
    front = AsyncEngine(engine)
    front.start()
    try:
        before = _Marker()
        outs = asyncio.run(front.pool([[1, 2, 3]], PoolingParams()))
        assert outs[0].error is None
        deadline = time.monotonic() + 10  # the loop freezes after the step that pooled it
        while not _frozen(before) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert _frozen(before)
    finally:
        front.shutdown()


def test_a_serving_loop_step_that_compiled_freezes(
    fresh_heap: None, tmp_path: Path, default_model_dir: Path
) -> None:
    # The clients send ids of a real vocabulary: a 2-layer BERT on MiniLM's (two blocks to
    # compile, not six).
    folder = save_hf_model(tiny_bert_head(transformers.BertModel), tmp_path / "tiny")
    engine = vecpool.Engine(with_minilm_tokenizer(folder, default_model_dir), device="cpu")
    compile_blocks(engine.model, backend="eager")
    before = _Marker()
    figures = serve_single_queries(engine, 4, 2)  # the server's engine loop, in this process
    assert figures["inputs_per_step"] > 0
    assert _frozen(before)


def test_switched_off_nothing_is_frozen(
    fresh_heap: None, monkeypatch: pytest.MonkeyPatch, tiny_bert: tuple[Path, Any]
) -> None:
    monkeypatch.setattr(heap, "FREEZE", False)
    engine = vecpool.Engine(tiny_bert[0], device="cpu")
    assert gc.get_freeze_count() == 0
    assert not _frozen(engine.model)


def test_a_compile_since_the_last_freeze_freezes_again(fresh_heap: None) -> None:
    heap.freeze()
    before = _Marker()
    heap.freeze_if_compiled()  # nothing compiled since
    assert not _frozen(before)

    torch._dynamo.reset()
    compiled = torch.compile(lambda x: x * 2 + 1, backend="eager")
    assert compiled(torch.ones(3)).tolist() == [3.0, 3.0, 3.0]
    heap.freeze_if_compiled()
    assert _frozen(before)
    after = _Marker()
    heap.freeze_if_compiled()  # that compile is counted: no freeze until the next one
    assert not _frozen(after)


def test_no_freeze_after_a_compile_before_the_first(fresh_heap: None) -> None:
    compiled = torch.compile(lambda x: x - 1, backend="eager")
    assert compiled(torch.ones(2)).tolist() == [0.0, 0.0]
    heap.freeze_if_compiled()  # only engines freeze first; a call follows one
    assert gc.get_freeze_count() == 0


def test_a_dropped_frozen_engine_frees_its_tensors(
    fresh_heap: None, tiny_bert: tuple[Path, Any]
) -> None:
    engine = vecpool.Engine(tiny_bert[0], device="cpu")
    assert engine.embed([[1, 2, 3]], show_progress=False).shape == (1, 32)
    weight = weakref.ref(next(engine.model.parameters()))
    core = weakref.ref(engine.core)
    assert weight() is not None and _frozen(weight())
    del engine
    gc.collect()  # walks no frozen object: what is freed here went by reference counts
    assert weight() is None
    assert core() is None


def test_a_dropped_frozen_engine_ends_its_tokenizer_processes(fresh_heap: None) -> None:
    engine = vecpool.Engine(device="cpu", tokenizer_processes=1)
    texts = ["a frozen engine still lets its children go " * 20] * 16  # a batch sent to them
    assert engine.embed(texts, show_progress=False).shape == (16, 384)
    pool = engine.inputs.tokenizer_pool
    assert pool is not None and pool.wait_ready(60)
    children = [child.proc for child in pool.children]
    assert children and all(proc.poll() is None for proc in children)
    assert _frozen(pool)
    del engine, pool
    gc.collect()  # walks no frozen object: the pool is closed by reference counts
    assert all(proc.wait(30) is not None for proc in children)
