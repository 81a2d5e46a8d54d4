"""Data parallel without processes: where the engines of a group are placed, and where a call
goes (the live engine with the fewest queued tokens, round robin among equals, never split)."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import numpy as np
import pytest
import torch

import vecpool
from vecpool.api import EngineArgs
from vecpool.calls import PoolingOutput, PromptRequest
from vecpool.errors import ConfigError, EngineDeadError
from vecpool.inputs.prompts import Prompt
from vecpool.server.engine_client import EngineProcessClient
from vecpool.server.engine_group import EngineGroupClient
from vecpool.tasks import PoolingParams


class FakeEngine:
    """An engine process's client that answers when told to: `release(i)` ends its i-th call."""

    def __init__(self, name: str):
        self.name = name
        self.max_queued = 100
        self.dead = False
        self.stuck = False  # lives, but does not answer a health check
        self.calls: list[int] = []  # requests of each call it was sent
        self.gates: list[asyncio.Future[None]] = []

    @property
    def num_queued(self) -> int:
        return sum(n for n, gate in zip(self.calls, self.gates, strict=True) if not gate.done())

    @property
    def is_running(self) -> bool:
        return not self.dead

    @property
    def health_problem(self) -> str | None:
        return f"{self.name} exited" if self.dead else None

    async def health(self) -> str | None:
        if self.stuck:
            return f"{self.name} did not answer within 5 s; it may be stuck"
        return self.health_problem

    async def start(self) -> None:
        pass

    async def close(self) -> None:
        pass

    async def run(
        self, requests: Sequence[PromptRequest], times: object = None
    ) -> list[PoolingOutput]:
        gate = asyncio.get_running_loop().create_future()
        self.calls.append(len(requests))
        self.gates.append(gate)
        await gate
        return [PoolingOutput(r.index, np.zeros(2, np.float32), None, 1) for r in requests]

    def release(self, i: int) -> None:
        self.gates[i].set_result(None)

    def die(self) -> None:
        self.dead = True
        for gate in self.gates:
            if not gate.done():
                gate.set_exception(EngineDeadError(f"{self.name} exited"))


def call(*lengths: int) -> list[PromptRequest]:
    params = PoolingParams(task="embed")
    return [
        PromptRequest(i, Prompt(token_ids=np.ones(n, np.int64), prompt_embeds=None), params)
        for i, n in enumerate(lengths)
    ]


def group(n: int) -> tuple[EngineGroupClient, list[FakeEngine]]:
    fakes = [FakeEngine(f"engine process {i}") for i in range(n)]
    clients: list[EngineProcessClient] = fakes  # type: ignore[assignment]
    return EngineGroupClient(clients), fakes


def test_calls_go_by_queued_tokens_not_count() -> None:
    async def scenario() -> None:
        client, (a, b) = group(2)
        tasks = [asyncio.create_task(client.run(call(500)))]  # one long call: engine 0
        await asyncio.sleep(0)
        for _ in range(4):  # short calls: all to engine 1 while 0 holds more tokens
            tasks.append(asyncio.create_task(client.run(call(10, 10))))
            await asyncio.sleep(0)
        assert a.calls == [1] and b.calls == [2, 2, 2, 2]
        assert client.queued_tokens == [500, 80]
        for i in range(4):
            b.release(i)
        await asyncio.gather(*tasks[1:])
        assert client.queued_tokens == [500, 0]
        a.release(0)
        await tasks[0]
        assert client.queued_tokens == [0, 0]

    asyncio.run(asyncio.wait_for(scenario(), 10))


def test_ties_go_round_robin() -> None:
    async def scenario() -> None:
        client, fakes = group(3)
        for _ in range(6):  # each answered before the next: always a tie
            task = asyncio.create_task(client.run(call(7)))
            await asyncio.sleep(0)
            for fake in fakes:
                if fake.gates and not fake.gates[-1].done():
                    fake.release(len(fake.gates) - 1)
            await task
        assert [len(f.calls) for f in fakes] == [2, 2, 2]

    asyncio.run(asyncio.wait_for(scenario(), 10))


def test_dead_engine_fails_its_calls_and_gets_no_more() -> None:
    async def scenario() -> None:
        client, (a, b) = group(2)
        first = asyncio.create_task(client.run(call(5)))
        second = asyncio.create_task(client.run(call(5)))
        await asyncio.sleep(0)
        assert a.calls == [1] and b.calls == [1]
        assert client.health_problem is None and client.is_running
        b.die()
        with pytest.raises(EngineDeadError, match="engine process 1"):
            await second
        assert client.is_running
        assert client.health_problem == "engine process 1 exited (1 of 2 engine processes serve)"
        third = asyncio.create_task(client.run(call(1)))  # to the survivor, though it is busier
        await asyncio.sleep(0)
        assert a.calls == [1, 1] and b.calls == [1]
        a.release(0)
        a.release(1)
        assert len(await first) == 1 and len(await third) == 1
        a.die()
        assert not client.is_running
        with pytest.raises(EngineDeadError, match="every engine process"):
            await client.run(call(1))

    asyncio.run(asyncio.wait_for(scenario(), 10))


def test_replicas_on_the_cpu_share_its_threads() -> None:
    replicas = EngineArgs(device="cpu", data_parallel_size=2).replicas()
    assert [r.rank for r in replicas] == [0, 1]
    assert all(r.args.device == "cpu" and r.args.data_parallel_size == 1 for r in replicas)
    assert all(r.threads == max(1, torch.get_num_threads() // 2) for r in replicas)
    (one,) = EngineArgs(device="cpu").replicas()
    assert one.threads == torch.get_num_threads()


def test_replicas_on_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    replicas = EngineArgs(device="cuda", data_parallel_size=2).replicas()
    assert [r.args.device for r in replicas] == ["cuda:0", "cuda:1"]
    with pytest.raises(ConfigError, match="needs 3 CUDA devices; this machine has 2"):
        EngineArgs(device="cuda", data_parallel_size=3).replicas()
    with pytest.raises(ConfigError, match="not cuda:1"):
        EngineArgs(device="cuda:1", data_parallel_size=2).replicas()
    with pytest.raises(ConfigError, match="data_parallel_size must be positive"):
        EngineArgs(data_parallel_size=0)


def test_python_engine_refuses_data_parallel() -> None:
    with pytest.raises(ConfigError, match="vecpool serve --data-parallel-size"):
        vecpool.Engine(device="cpu", data_parallel_size=2)


def test_a_stuck_engine_fails_the_groups_health_check_naming_it() -> None:
    async def scenario() -> None:
        client, (_, b, c) = group(3)
        assert await client.health() is None
        b.stuck = True
        assert client.is_running and client.health_problem is None  # its process lives
        assert await client.health() == (
            "engine process 1 did not answer within 5 s; it may be stuck "
            "(2 of 3 engine processes serve)"
        )
        c.die()
        assert await client.health() == (
            "engine process 1 did not answer within 5 s; it may be stuck; "
            "engine process 2 exited (1 of 3 engine processes serve)"
        )

    asyncio.run(asyncio.wait_for(scenario(), 10))
