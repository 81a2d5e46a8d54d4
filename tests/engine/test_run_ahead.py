"""A step of whole prompts is pooled after the next step's forward is queued (`EngineCore.step`):
the order of forwards and poolings, results identical to pooling each step at once, steps of
chunked prompts kept in order, and a failure in a deferred pooling costing its input alone.

The order is observed by wrapping the runners' `forward` and `pool`; identity with the
in-order engine is bit for bit, because both run the same steps through the same kernels (only
when each step is pooled differs)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

import vecpool
from tests.helpers import random_prompts, save_hf_model
from tests.models.test_decoders import ARCHS
from vecpool.engine.request import RequestStatus
from vecpool.errors import RequestFailedError
from vecpool.runner.step import StepInput
from vecpool.tasks import PoolingParams

BUDGET = 24  # tokens a step: 4 prompts of 6


def _trace(engine: vecpool.Engine, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The runners' calls from now on, in order: "F<step>" per forward, "P<step>" per pooling,
    steps numbered by their first input's first token (each test gives every prompt its own)."""
    calls: list[str] = []
    forward, pool = engine.model_runner.forward, engine.core.pooling_runner.pool

    def traced_forward(batch: Any) -> Any:
        calls.append(f"F{int(batch.input_ids[0])}")
        return forward(batch)

    def traced_pool(hidden: Any, batch: Any, step: Any, **kwargs: Any) -> Any:
        calls.append(f"P{int(batch.input_ids[0])}")
        return pool(hidden, batch, step, **kwargs)

    monkeypatch.setattr(engine.model_runner, "forward", traced_forward)
    monkeypatch.setattr(engine.core.pooling_runner, "pool", traced_pool)
    return calls


def _prompts(n: int, length: int, seed: int) -> list[list[int]]:
    """`n` prompts whose first tokens are 10, 11, ...: a step is named by its first prompt's."""
    body = random_prompts(70, [length - 1] * n, seed)  # ids 20..89: in both models' vocabularies
    return [[10 + i, *(t + 20 for t in p)] for i, p in enumerate(body)]


@pytest.fixture
def bert(tiny_bert: tuple[Path, Any]) -> vecpool.Engine:
    return vecpool.Engine(tiny_bert[0], device="cpu", max_num_batched_tokens=BUDGET)


def test_whole_prompts_pool_after_the_next_forward_with_the_same_results(
    bert: vecpool.Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    prompts = _prompts(12, 6, seed=1)  # three steps of four, in order (all of one length)
    with monkeypatch.context() as m:  # the order before: each step pooled at once
        m.setattr(StepInput, "independent", property(lambda self: False))
        calls = _trace(bert, m)
        in_order = bert.embed(prompts)
        assert calls == ["F10", "P10", "F14", "P14", "F18", "P18"]
    calls = _trace(bert, monkeypatch)
    ahead = bert.embed(prompts)
    # Each step's pooling waits for the next step's forward; the last is pooled at once.
    assert calls == ["F10", "F14", "P10", "F18", "P14", "P18"]
    assert np.array_equal(ahead, in_order)
    assert not bert.core.has_work()


def test_a_deferred_pooling_that_fails_costs_its_input_alone(
    bert: vecpool.Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    prompts = _prompts(12, 6, seed=2)
    expected = bert.embed(prompts)
    poison = prompts[5][0]  # the second step's second input
    pool = bert.core.pooling_runner.pool

    def fails_on_poison(hidden: Any, batch: Any, step: Any, **kwargs: Any) -> Any:
        if bool((batch.input_ids == poison).any()):
            raise RuntimeError("pooling fell over")
        return pool(hidden, batch, step, **kwargs)

    monkeypatch.setattr(bert.core.pooling_runner, "pool", fails_on_poison)
    outs = bert.pool(prompts, PoolingParams())
    assert isinstance(outs[5].error, RequestFailedError)
    assert "pooling fell over" in str(outs[5].error)
    rest = [i for i in range(12) if i != 5]
    assert all(outs[i].error is None for i in rest)
    # The others of the failed step ran again in halves, in other batches: sums in another
    # order, within an ulp or two of float32.
    np.testing.assert_allclose(np.stack([outs[i].data for i in rest]), expected[rest], atol=1e-6)
    assert bert.core.healthy and not bert.core.has_work()


def test_steps_of_chunked_prompts_pool_before_the_next_forward(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    arch = next(a for a in ARCHS if a.name == "qwen3")
    folder = save_hf_model(arch.hf_model(), tmp_path / "qwen3")
    engine = vecpool.Engine(folder, device="cpu", max_num_batched_tokens=16)
    long = _prompts(1, 40, seed=3)[0]  # three chunks: 16, 16, 8
    expected = engine.embed([long])
    calls = _trace(engine, monkeypatch)
    requests = engine.make_requests([long], PoolingParams())
    engine.core.add_requests(requests)
    while engine.core.has_work():
        engine.core.step()
    # A chunk's pooling carries state into the next chunk's: each step pooled before the next.
    assert [c[0] for c in calls] == ["F", "P", "F", "P", "F", "P"]
    assert requests[0].status == RequestStatus.FINISHED
    assert requests[0].output is not None
    assert np.array_equal(requests[0].output, expected[0])


def test_requests_received_while_a_step_is_queued_let_it_pool_behind_the_next(
    bert: vecpool.Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A server takes its requests between steps: those that arrive while a step's forward is
    queued (`step(receive)`) make the next step, launched before that one is pooled."""
    prompts = _prompts(8, 6, seed=4)
    expected = np.concatenate([bert.embed(prompts[:4]), bert.embed(prompts[4:])])
    first, second = (bert.make_requests(p, PoolingParams()) for p in (prompts[:4], prompts[4:]))
    calls = _trace(bert, monkeypatch)
    core = bert.core
    core.add_requests(first)

    def receive() -> None:
        if not second[0].num_scheduled_tokens and second[0] not in core.scheduler.waiting:
            core.add_requests(second)

    assert core.step(receive) == 4
    assert calls == ["F10"] and core.has_work()  # pooled behind the step just received
    assert core.step(receive) == 4
    assert calls == ["F10", "F14", "P10", "P14"] and not core.has_work()
    requests = [*first, *second]
    assert all(r.status == RequestStatus.FINISHED for r in requests)
    assert np.array_equal(np.stack([r.output for r in requests]), expected)


def test_a_failed_callers_requests_run_out_and_others_finish(
    bert: vecpool.Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`EngineCore.run_out`: a caller's cancelled requests in the step in flight, in the step
    prepared behind it and in the queue leave the engine (the one in flight pooled, the
    prepared one never run, the queued ones dropped by the step that runs another caller's
    requests in their place, which ride along)."""
    prompts = _prompts(16, 6, seed=5)
    expected = bert.embed(prompts[12:])
    ours = bert.make_requests(prompts[:12], PoolingParams())  # three steps of four
    theirs = bert.make_requests(prompts[12:], PoolingParams())
    core = bert.core
    core.add_requests(ours)
    core.add_requests(theirs)
    calls = _trace(bert, monkeypatch)
    core.step()  # the first step in flight, the second prepared behind it
    assert calls == ["F10"] and core.has_work()
    for request in ours:
        request.cancel()
    core.run_out(ours)
    # The prepared step of cancelled requests never ran; theirs ran alone, as they would have.
    assert calls == ["F10", "P10", "F22", "P22"] and not core.has_work()
    assert all(r.status == RequestStatus.CANCELLED for r in ours)
    assert all(r.status == RequestStatus.FINISHED for r in theirs)
    assert np.array_equal(np.stack([r.output for r in theirs]), expected)
