"""An engine process of `vecpool embed --data-parallel-size N` (`_worker_main`), run in this
process with plain queues: it tokenizes the next chunk while the engine runs the current one,
answers each chunk in order, and reports an input's error and a failure as the parent reads
them."""

from __future__ import annotations

import os
import queue
import threading
from typing import Any

import numpy as np
import pytest

from vecpool.api import Engine
from vecpool.api.args import EngineArgs, Replica
from vecpool.calls import EmbedOptions
from vecpool.cli import parallel
from vecpool.errors import InputError


def _run_worker(
    engine: Engine, monkeypatch: pytest.MonkeyPatch, tasks: list[Any]
) -> list[tuple[Any, ...]]:
    monkeypatch.setattr(Engine, "from_args", classmethod(lambda cls, args: engine))
    inbox: queue.Queue[Any] = queue.Queue()
    for task in tasks:
        inbox.put(task)
    results: queue.Queue[Any] = queue.Queue()
    replica = Replica(0, EngineArgs(device="cpu"), threads=1)
    parallel._worker_main(replica, EmbedOptions(), inbox, results, os.getppid())
    return [results.get_nowait() for _ in range(results.qsize())]


def test_the_next_chunk_is_prepared_while_one_runs(
    tiny_bert_engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    prepared_second = threading.Event()
    seen_while_running: list[bool] = []
    prepare, run = parallel.prepare_chunk, parallel.run_chunk

    def prepare_chunk(engine: Engine, options: EmbedOptions, inputs: list[Any]) -> Any:
        call = prepare(engine, options, inputs)
        if inputs[0] == [7, 8, 9]:  # the second chunk
            prepared_second.set()
        return call

    def run_chunk(engine: Engine, options: EmbedOptions, call: Any) -> Any:
        if not seen_while_running:  # the first chunk: does the second get prepared meanwhile?
            seen_while_running.append(prepared_second.wait(timeout=30))
        return run(engine, options, call)

    monkeypatch.setattr(parallel, "prepare_chunk", prepare_chunk)
    monkeypatch.setattr(parallel, "run_chunk", run_chunk)
    chunks = [[[5, 6], [10, 11, 12]], [[7, 8, 9]], [[13], [14, 15], [16, 17, 18, 19]]]
    messages = _run_worker(tiny_bert_engine, monkeypatch, [*enumerate(chunks), None])
    assert seen_while_running == [True]
    assert messages[0][0] == "ready"
    assert [(m[0], m[1]) for m in messages[1:]] == [("done", 0), ("done", 1), ("done", 2)]
    for (_, _, vectors, tokens), chunk in zip(messages[1:], chunks, strict=True):
        assert np.array_equal(vectors, np.stack(tiny_bert_engine.embed(chunk)))
        assert tokens == sum(map(len, chunk))


def test_an_input_error_and_a_failure_are_reported(
    tiny_bert_engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    prepare = parallel.prepare_chunk

    def prepare_chunk(engine: Engine, options: EmbedOptions, inputs: list[Any]) -> Any:
        if inputs == [[3, 2, 1]]:
            raise RuntimeError("the reader failed")
        return prepare(engine, options, inputs)

    monkeypatch.setattr(parallel, "prepare_chunk", prepare_chunk)
    tasks = [
        (0, [[5, 6], "a text"]),  # no tokenizer: that input's error, and the worker goes on
        (1, [[5, 6]]),
        (2, [[3, 2, 1]]),  # the reader fails: the worker reports it and stops
        (3, [[7, 8]]),
    ]
    messages = _run_worker(tiny_bert_engine, monkeypatch, tasks)
    assert messages[1][:3] == ("input_error", 0, 1)
    assert messages[2][:2] == ("done", 1)
    assert messages[3] == ("failed", "EngineError", "RuntimeError: the reader failed")
    assert len(messages) == 4
    with pytest.raises(InputError) as error:
        tiny_bert_engine.embed([[5, 6], "a text"])
    assert messages[1][4] == error.value.reason
