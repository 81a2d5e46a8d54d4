"""The in-process asyncio front: concurrent callers, a bounded queue, cancellation, timings."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

import vecpool
from tests.helpers import random_prompts
from vecpool.api.async_engine import AsyncEngine, EngineDeadError, QueueFullError
from vecpool.calls.outputs import RunTimes
from vecpool.tasks import PoolingParams


@pytest.fixture
def front(tiny_bert_engine: vecpool.Engine):
    front = AsyncEngine(tiny_bert_engine, max_queued=8)
    front.start()
    yield front
    front.shutdown()


async def _queued(front: AsyncEngine, n: int) -> None:
    """Until `n` inputs are queued (a call's first steps, on this event loop); the 30,000
    looks (30 s or more) only bound a failure."""
    for _ in range(30_000):
        if front.num_queued == n:
            return
        await asyncio.sleep(0.001)
    raise AssertionError(f"{front.num_queued} inputs queued, not {n}")


def test_concurrent_async_callers(front: AsyncEngine, tiny_bert_engine: vecpool.Engine) -> None:
    groups = [random_prompts(99, [3 + i, 11, 6], seed=40 + i) for i in range(2)]
    expected = [tiny_bert_engine.embed(g) for g in groups]

    async def main() -> list[list[vecpool.PoolingOutput]]:
        calls = [front.pool(g, PoolingParams()) for g in groups]
        bad = front.pool([[5, 6], {"prompt_embeds": np.zeros((2, 3), np.float32)}], PoolingParams())
        results = await asyncio.gather(*calls, bad, return_exceptions=True)
        assert isinstance(results[-1], vecpool.InputError) and results[-1].index == 1
        return results[:-1]

    results = asyncio.run(main())
    for outs, exp in zip(results, expected, strict=True):
        got = np.stack([o.data for o in outs])
        assert np.abs(got - exp).max() <= 1e-6
    assert front.num_queued == 0


def test_full_queue_refuses_at_once(front: AsyncEngine) -> None:
    async def main() -> None:
        requests = await front.make_requests(random_prompts(99, [4] * 9), PoolingParams())
        with pytest.raises(QueueFullError, match="the queue is full"):
            await front.run(requests)
        assert front.num_queued == 0
        outs = await front.run(requests[:8])
        assert all(o.error is None for o in outs)

    asyncio.run(main())


def test_cancelled_caller_drops_waiting_requests(
    tiny_bert_engine: vecpool.Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    outcomes: list[str] = []
    front = AsyncEngine(tiny_bert_engine, on_request_done=lambda r: outcomes.append(r.status.value))
    core = tiny_bert_engine.core
    has_work = core.has_work
    monkeypatch.setattr(core, "has_work", lambda: False)  # the loop never steps: all waits
    front.start()

    async def main() -> None:
        requests = await front.make_requests(random_prompts(99, [5, 7]), PoolingParams())
        task = asyncio.ensure_future(front.run(requests))
        await _queued(front, 2)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    front.shutdown()
    monkeypatch.setattr(core, "has_work", has_work)
    steps = core.num_steps
    assert outcomes == ["cancelled", "cancelled"]
    assert core.step() == 0  # the queue skips them: no work runs
    assert core.num_steps == steps
    assert front.num_queued == 0


def test_an_engine_not_running_answers_at_once(
    tiny_bert_engine: vecpool.Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Calls before `start()` and after `shutdown()` raise `EngineDeadError`; calls waiting
    when it shuts down get it as their inputs' error: none waits for good."""
    front = AsyncEngine(tiny_bert_engine)
    prompts = random_prompts(99, [5, 7])

    async def before_start() -> None:
        requests = await front.make_requests(prompts, PoolingParams())
        with pytest.raises(EngineDeadError, match=r"start\(\) not called"):
            await asyncio.wait_for(front.run(requests), 10)

    asyncio.run(before_start())
    core = tiny_bert_engine.core
    monkeypatch.setattr(core, "has_work", lambda: False)  # what is queued waits
    front.start()

    async def at_shutdown() -> list[vecpool.PoolingOutput]:
        requests = await front.make_requests(prompts, PoolingParams())
        task = asyncio.ensure_future(front.run(requests))
        await _queued(front, 2)
        assert not task.done()
        await asyncio.get_running_loop().run_in_executor(None, front.shutdown)
        outs = await asyncio.wait_for(task, 10)
        with pytest.raises(EngineDeadError, match="was shut down"):
            await asyncio.wait_for(front.run(requests), 10)
        return outs

    outs = asyncio.run(at_shutdown())
    assert [o.index for o in outs] == [0, 1]
    for out in outs:
        assert out.data is None and isinstance(out.error, EngineDeadError)
        assert "shut down before this input ran" in str(out.error)
    assert front.num_queued == 0
    monkeypatch.undo()
    core.step()  # the cancelled requests leave the queue without running
    assert not core.has_work()


def test_run_reports_where_the_time_went(front: AsyncEngine) -> None:
    async def main() -> RunTimes:
        times = RunTimes()
        requests = await front.make_requests(random_prompts(99, [6, 9]), PoolingParams())
        outs = await front.run(requests, times)
        assert [o.index for o in outs] == [0, 1] and all(o.error is None for o in outs)
        return times

    times = asyncio.run(main())
    assert times.queue >= 0 and times.inference > 0
