"""The in-process asyncio front: concurrent callers, a bounded queue, cancellation, timings."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

import vecpool
from tests.helpers import random_prompts
from vecpool.api.async_engine import AsyncEngine, QueueFullError
from vecpool.calls.outputs import RunTimes
from vecpool.tasks import PoolingParams


@pytest.fixture
def front(tiny_bert_engine: vecpool.Engine):
    front = AsyncEngine(tiny_bert_engine, max_queued=8)
    front.start()
    yield front
    front.shutdown()


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


def test_cancelled_caller_drops_waiting_requests(tiny_bert_engine: vecpool.Engine) -> None:
    outcomes: list[str] = []
    # Not started: nothing runs until we say so.
    front = AsyncEngine(tiny_bert_engine, on_request_done=lambda r: outcomes.append(r.status.value))

    async def main() -> None:
        requests = await front.make_requests(random_prompts(99, [5, 7]), PoolingParams())
        task = asyncio.ensure_future(front.run(requests))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    steps = tiny_bert_engine.core.num_steps
    assert outcomes == ["cancelled", "cancelled"]
    assert tiny_bert_engine.core.step() == 0  # the queue skips them: no work runs
    assert tiny_bert_engine.core.num_steps == steps
    assert front.num_queued == 0


def test_run_reports_where_the_time_went(front: AsyncEngine) -> None:
    async def main() -> RunTimes:
        times = RunTimes()
        requests = await front.make_requests(random_prompts(99, [6, 9]), PoolingParams())
        outs = await front.run(requests, times)
        assert [o.index for o in outs] == [0, 1] and all(o.error is None for o in outs)
        return times

    times = asyncio.run(main())
    assert times.queue >= 0 and times.inference > 0
