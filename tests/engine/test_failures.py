"""Whose fault is a failed step: an input's, or the engine's? Told apart by evidence (the
engine's probe), not by counting; and a loop whose step keeps raising backs off and turns
unhealthy instead of spinning.

Faults are injected by a forward pre-hook on the tiny BERT's embedding lookup that raises when
a marked token id is looked up: the input's fault, whether it runs alone or in a batch.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import vecpool
from tests.helpers import random_prompts
from vecpool.engine import core as engine_core
from vecpool.errors import EngineError, RequestFailedError
from vecpool.tasks import PoolingParams

POISON = 50  # the marked token id: looking it up raises (not among the probe's ids, 1..8)


@pytest.fixture
def engine(tiny_bert_engine: vecpool.Engine) -> Iterator[vecpool.Engine]:
    """The session's tiny BERT engine with the fault injected on `POISON`."""

    def fault(module: Any, args: tuple[Any, ...]) -> None:
        if bool((args[0] == POISON).any()):
            raise RuntimeError(f"injected fault on token id {POISON}")

    handle = tiny_bert_engine.model.embeddings.word_embeddings.register_forward_pre_hook(fault)
    yield tiny_bert_engine
    handle.remove()
    tiny_bert_engine.core.engine_at_fault = False
    tiny_bert_engine.core.loop_errors = 0


def _good(n: int, seed: int) -> list[list[int]]:
    return [
        [i if i != POISON else POISON + 1 for i in p] for p in random_prompts(99, [6] * n, seed)
    ]


def test_poison_inputs_sent_alone_fail_alone_and_the_engine_stays_healthy(
    engine: vecpool.Engine,
) -> None:
    (good,) = _good(1, seed=1)
    expected = engine.embed([good])
    for i in range(10):
        (out,) = engine.pool([[5, POISON, 9 + i]], PoolingParams())
        assert isinstance(out.error, RequestFailedError), out.error
        assert f"injected fault on token id {POISON}" in str(out.error)
        assert engine.core.healthy
    assert not engine.core.engine_at_fault
    assert np.array_equal(engine.embed([good]), expected)


def test_a_poison_input_in_a_batch_fails_alone(engine: vecpool.Engine) -> None:
    good = _good(5, seed=2)
    alone = engine.embed(good)
    outs = engine.pool([*good[:2], [POISON, 3], *good[2:]], PoolingParams())
    assert isinstance(outs[2].error, RequestFailedError)
    got = np.stack([o.data for i, o in enumerate(outs) if i != 2])
    # Other batch compositions sum in another order: within an ulp or two of fp32.
    np.testing.assert_allclose(got, alone, atol=1e-6)
    assert engine.core.healthy


def test_a_broken_engine_fails_the_probe_too(
    engine: vecpool.Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every forward raises: the probe fails as well, so the engine is at fault (EngineError,
    unhealthy) whether the request ran alone or in a batch; a later step that computes makes
    it healthy again."""

    def broken(batch: Any) -> Any:
        raise RuntimeError("device lost")

    with monkeypatch.context() as m:
        m.setattr(engine.core.model_runner, "forward", broken)
        for inputs in (_good(1, seed=3), _good(4, seed=4)):
            outs = engine.pool(inputs, PoolingParams())
            for out in outs:
                assert isinstance(out.error, EngineError), out.error
                assert "device lost" in str(out.error) and "known-good" in str(out.error)
            assert not engine.core.healthy
    assert engine.embed(_good(1, seed=5)).shape == (1, 32)
    assert engine.core.healthy


def test_a_loop_error_outside_the_model_backs_off_then_turns_unhealthy(
    engine: vecpool.Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    core = engine.core
    delays: list[float] = []
    # `time.sleep` is the process's: other threads (left by earlier tests) sleep through it
    # too, and only this thread's steps are counted (the others' sleeps stay real).
    this_thread, real_sleep = threading.current_thread(), time.sleep

    def sleep(seconds: float) -> None:
        if threading.current_thread() is this_thread:
            delays.append(seconds)
        else:
            real_sleep(seconds)

    monkeypatch.setattr(engine_core.time, "sleep", sleep)
    with monkeypatch.context() as m:

        def schedule() -> Any:
            raise RuntimeError("scheduler bug")

        m.setattr(core.scheduler, "schedule", schedule)
        for _ in range(engine_core.UNHEALTHY_AFTER_LOOP_ERRORS):
            assert core.healthy
            assert core.guarded_step() == 0
        assert not core.healthy
        core.loop_errors = 20  # long after: the wait stays at its cap
        core.guarded_step()
    assert delays == [0.01, 0.02, 0.04, 0.08, 0.16, engine_core.LOOP_ERROR_MAX_DELAY]
    # The fault gone, the next step runs and the engine is healthy again.
    requests = engine.make_requests(_good(2, seed=6), PoolingParams())
    core.add_requests(requests)
    assert core.guarded_step() == 2
    assert core.healthy and all(r.output is not None for r in requests)


@pytest.mark.parametrize("where", ["event", "schedule"])
def test_a_step_raising_outside_its_guarded_regions_fails_the_requests_it_took(
    engine: vecpool.Engine, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    """`step` raises after it took a step off the queue: recording the forward's end
    (`event`), or scheduling the step after it once the forward was queued (`schedule`). The
    taken requests fail with an EngineError naming the error (they were held by nothing and
    waited for good); a request queued after them runs in the next step."""
    core = engine.core
    monkeypatch.setattr(engine_core.time, "sleep", lambda seconds: None)
    taken = engine.make_requests(_good(3, seed=7), PoolingParams())
    behind = engine.make_requests(_good(1, seed=8), PoolingParams())
    real_schedule = core.scheduler.schedule
    schedules = 0

    def schedule() -> Any:
        nonlocal schedules
        schedules += 1
        if schedules == 2:
            raise RuntimeError("scheduler bug")
        return real_schedule()

    def forward_done() -> Any:
        raise RuntimeError("event lost")

    with monkeypatch.context() as m:
        if where == "event":
            m.setattr(core.pooling_runner, "forward_done", forward_done)
        else:
            m.setattr(core.scheduler, "schedule", schedule)
        core.add_requests(taken)
        assert core.guarded_step() == 0
    message = "event lost" if where == "event" else "scheduler bug"
    for request in taken:
        assert isinstance(request.error, EngineError), request.error
        assert f"failed outside the model: RuntimeError: {message}" in str(request.error)
    core.add_requests(behind)
    assert core.guarded_step() == 1
    assert behind[0].output is not None and behind[0].output.shape == (32,)
    assert not core.has_work() and core.healthy
