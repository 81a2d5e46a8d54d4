"""Every forward and pooling of a step runs inside `ModelRunner.on_device` (the model's device
made current: on CUDA, what torch and Triton put on the current device then lands on the
model's, whichever device the calling thread had), from the caller's thread and from a thread
of its own. On the CPU the scope is a no-op; two H200s are where it matters
(`benchmarks/lab/second_device_check.py`)."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import pytest

import vecpool
from tests.helpers import random_prompts


def test_steps_run_on_the_models_device(
    tiny_bert_engine: vecpool.Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    runner, pooling = tiny_bert_engine.model_runner, tiny_bert_engine.core.pooling_runner
    assert isinstance(runner.on_device(), contextlib.nullcontext)  # the CPU: nothing to switch
    inside = threading.local()
    seen: list[tuple[str, bool]] = []

    @contextlib.contextmanager
    def on_device() -> Iterator[None]:
        inside.depth = getattr(inside, "depth", 0) + 1
        try:
            yield
        finally:
            inside.depth -= 1

    forward, pool = runner.forward, pooling.pool

    def traced_forward(batch: Any) -> Any:
        seen.append(("forward", getattr(inside, "depth", 0) > 0))
        return forward(batch)

    def traced_pool(*args: Any, **kwargs: Any) -> Any:
        seen.append(("pool", getattr(inside, "depth", 0) > 0))
        return pool(*args, **kwargs)

    monkeypatch.setattr(runner, "on_device", on_device)
    monkeypatch.setattr(runner, "forward", traced_forward)
    monkeypatch.setattr(pooling, "pool", traced_pool)
    prompts = random_prompts(99, [5, 9, 3, 12], seed=3)
    tiny_bert_engine.embed(prompts)
    thread = threading.Thread(target=tiny_bert_engine.embed, args=(prompts[:2],))
    thread.start()
    thread.join()
    assert {kind for kind, _ in seen} == {"forward", "pool"}
    assert all(ok for _, ok in seen), seen
