"""The engine process's loop and its client, in one process (the loop in a thread): what an
API process sends comes back as the engine computes it; cancelling drops the work; a full
queue refuses; an idle engine waits for more before it steps; the engine's exit fails the
calls in flight; the messages carry arrays exactly. Where the loop waits on a clock (an idle
engine gathering a step), the test decides when the wait ends (`DeclaredPauses`)."""

from __future__ import annotations

import asyncio
import math
import multiprocessing as mp
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
import zmq

import vecpool
from tests.helpers import random_prompts
from vecpool import calls
from vecpool.calls import PoolingOutput, PromptRequest
from vecpool.errors import (
    EngineDeadError,
    EngineError,
    InputError,
    QueueFullError,
    RequestFailedError,
)
from vecpool.inputs.prompts import Prompt
from vecpool.server import engine_client, engine_process, wire
from vecpool.server.engine_client import EngineProcessClient
from vecpool.server.engine_process import EngineLoop, EngineProcessConfig
from vecpool.tasks import PoolingParams


class RunningLoop:
    """An `EngineLoop` serving in a thread until `stop()`."""

    def __init__(self, engine: vecpool.Engine, address: str, **config: float):
        settings = {"max_queued": 64, "batch_wait": 0.0, **config}
        self.loop = EngineLoop(
            engine,
            EngineProcessConfig(
                address,
                int(settings["max_queued"]),
                settings["batch_wait"],
                max_wait=settings.get("max_wait"),
            ),
            metrics=None,
        )
        self.parent, self._parent_writer = mp.Pipe(duplex=False)
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            self.loop.run(self.parent)
        finally:
            self.loop.close()

    def stop(self) -> None:
        self._parent_writer.close()  # the loop sees its "parent" gone and returns
        self.thread.join(timeout=10)
        assert not self.thread.is_alive()


class DeclaredPauses:
    """The idle engine's gather, with the clock taken out: its wait for more calls ends when
    the test declares a pause in arrivals (`pause()`), not after `GATHER_GAP` of silence on a
    machine that may stall for longer than that between two calls of a burst. Calls that
    arrive meanwhile are taken as the real poller takes them; the gap the loop asked for is
    recorded."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch):
        self.paused = threading.Event()
        self.gaps: list[int] = []  # the timeouts (ms) the gather polled with
        pauses = self

        class Poller(zmq.Poller):
            def poll(self, timeout: int | None = None) -> list[tuple[object, int]]:
                if not timeout:  # None: idle, waiting for a call; 0: a look between steps
                    return list(super().poll(timeout))
                pauses.gaps.append(timeout)
                while True:
                    events = list(super().poll(5))
                    if events or pauses.paused.is_set():
                        return events

        proxy = type("zmq", (), {"__getattr__": lambda _, name: getattr(zmq, name)})()
        proxy.Poller = Poller
        monkeypatch.setattr(engine_process, "zmq", proxy)

    def pause(self) -> None:
        self.paused.set()


class ClientClock:
    """The engine client's `time.monotonic`, moved by the test alone: the wait a reply
    reported runs down by exactly the seconds the test lets pass, however long the test's
    own steps take."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, now: float = 1000.0):
        self.now = now
        proxy = type("time", (), {"__getattr__": lambda _, name: getattr(time, name)})()
        proxy.monotonic = lambda: self.now
        monkeypatch.setattr(engine_client, "time", proxy)


async def _until(predicate: Callable[[], bool], timeout: float = 30) -> None:
    """Until `predicate()`: something the loop thread will do; `timeout` bounds a failure."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline
        await asyncio.sleep(0.002)


@pytest.fixture
def address(tmp_path: Path) -> str:
    return f"ipc://{tmp_path}/engine"


@pytest.fixture
def serving(tiny_bert_engine: vecpool.Engine, address: str) -> Iterator[RunningLoop]:
    loop = RunningLoop(tiny_bert_engine, address)
    yield loop
    loop.stop()


def _run(address: str, fn) -> object:  # type: ignore[no-untyped-def]
    async def main() -> object:
        client = EngineProcessClient(address, None, max_queued=8)
        await client.start()
        try:
            return await fn(client)
        finally:
            await client.close()

    return asyncio.run(main())


def test_calls_come_back_as_the_engine_computes_them(
    serving: RunningLoop, tiny_bert_engine: vecpool.Engine, address: str
) -> None:
    groups = [random_prompts(99, [3 + i, 11, 6], seed=50 + i) for i in range(3)]
    expected = [tiny_bert_engine.embed(g) for g in groups]
    ctx = tiny_bert_engine.context

    async def calls_at_once(client: EngineProcessClient) -> list[list[PoolingOutput]]:
        prepared = [calls.prepare_encode(ctx, g, task="embed") for g in groups]
        return list(await asyncio.gather(*(client.run(p.requests) for p in prepared)))

    results = _run(address, calls_at_once)
    assert isinstance(results, list)
    for outs, exp in zip(results, expected, strict=True):
        assert [o.index for o in outs] == [0, 1, 2]
        assert np.abs(np.stack([o.data for o in outs]) - exp).max() <= 1e-6


def test_a_full_queue_refuses(tiny_bert_engine: vecpool.Engine, address: str) -> None:
    ctx = tiny_bert_engine.context
    loop = RunningLoop(tiny_bert_engine, address, max_queued=8)
    try:

        async def scenario(client: EngineProcessClient) -> None:
            nine = calls.make_requests(ctx, random_prompts(99, [4] * 9), PoolingParams())
            with pytest.raises(QueueFullError, match=r"the queue is full \(0 of 8"):
                await client.run(nine)
            outs = await client.run(nine[:8])
            assert all(o.error is None for o in outs)
            assert client.num_queued == 0

        _run(address, scenario)
    finally:
        loop.stop()


def test_the_engine_admits_by_expected_wait_and_reports_it(
    tiny_bert_engine: vecpool.Engine, address: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """At 10 tokens/s and a bound of 1 s, with 20 tokens queued: a call of 5 tokens (2.5 s of
    work) is refused, and the API side learns the engine's expected wait (2 s) from the
    reply, to refuse before reading a body; with the queue empty, a call of any size runs."""
    ctx = tiny_bert_engine.context
    ClientClock(monkeypatch)  # no time passes on the client's side
    loop = RunningLoop(tiny_bert_engine, address, max_wait=1.0)
    admission = loop.loop.admission
    admission.tokens_per_second = 10.0
    admission.add(4, 20)  # as if four inputs of 5 tokens were queued (the loop is idle)
    try:

        async def scenario(client: EngineProcessClient) -> None:
            one = calls.make_requests(ctx, random_prompts(99, [5], seed=4), PoolingParams())
            with pytest.raises(QueueFullError, match=r"about 2\.5 s of work"):
                await client.run(one)
            assert client.expected_wait == 2.0  # as the reply said
            admission.add(-4, -20)
            many = calls.make_requests(ctx, random_prompts(99, [30] * 4, seed=5), PoolingParams())
            assert all(o.error is None for o in await client.run(many))  # 12 s of work alone
            assert client.expected_wait == 0.0  # the last reply found the queue empty

        _run(address, scenario)
    finally:
        loop.stop()


def test_the_reported_wait_runs_down_with_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """The wait an engine reported runs down as it works the queue off. A process whose calls
    are all answered hears from the engine no more: past `STALE_WAIT` it stops acting on the
    engine's word and lets the next call ask, so one misjudged word (77.6 s reported once, on
    an engine whose queue held under a second of work) cannot refuse everyone for minutes."""
    clock = ClientClock(monkeypatch)
    client = EngineProcessClient("ipc:///nowhere", None, max_queued=8)
    loop = asyncio.new_event_loop()
    client._pending[1] = loop.create_future()  # a call of ours waits
    client._engine_wait, client._engine_wait_at = 5.0, clock.now
    clock.now += 4.0
    assert client.expected_wait == 1.0
    clock.now += 2.0
    assert client.expected_wait == 0.0
    client._engine_wait, client._engine_wait_at = 80.0, clock.now
    clock.now += 0.5
    assert client.expected_wait == 79.5  # fresh: refused before the body is read
    del client._pending[1]
    assert client.expected_wait == 79.5  # within STALE_WAIT of the reply
    clock.now += engine_client.STALE_WAIT - 0.5
    assert client.expected_wait == 80.0 - engine_client.STALE_WAIT  # at STALE_WAIT, still
    clock.now += 0.25
    assert client.expected_wait == 0.0  # stale, and nothing of ours there: ask the engine
    loop.close()
    client._engine_queued = 8  # stale: no call of ours is pending
    assert client.num_queued == 0


def test_an_engine_whose_steps_all_fail_exits(
    tiny_bert_engine: vecpool.Engine, address: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every request failing alone, step after step: the loop returns (the process exits,
    which fails the calls of every API process and turns /health to 503)."""
    ctx = tiny_bert_engine.context

    def broken(batch):  # type: ignore[no-untyped-def]
        raise RuntimeError("device lost")

    monkeypatch.setattr(tiny_bert_engine.core.model_runner, "forward", broken)
    loop = RunningLoop(tiny_bert_engine, address)
    try:

        async def scenario(client: EngineProcessClient) -> None:
            four = calls.make_requests(ctx, random_prompts(99, [5] * 4, seed=5), PoolingParams())
            outs = await client.run(four)
            assert all(isinstance(o.error, EngineError) for o in outs)

        _run(address, scenario)
        loop.thread.join(60)  # only bounds a failure: the loop returns after that step
        assert not loop.thread.is_alive()
    finally:
        loop.stop()
        tiny_bert_engine.core.engine_at_fault = False


def test_a_cancelled_call_is_dropped(
    tiny_bert_engine: vecpool.Engine, address: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    ctx = tiny_bert_engine.context
    # The engine gathers until the test declares a pause: the cancel arrives before any step.
    pauses = DeclaredPauses(monkeypatch)
    loop = RunningLoop(tiny_bert_engine, address, batch_wait=60.0)
    steps = tiny_bert_engine.core.num_steps
    try:

        async def scenario(client: EngineProcessClient) -> None:
            two = calls.make_requests(ctx, random_prompts(99, [4, 6]), PoolingParams())
            task = asyncio.ensure_future(client.run(two))
            await _until(lambda: loop.loop.admission.queued == 2)  # gathering with the call
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert client.num_queued == 0
            await _until(lambda: not loop.loop.calls)  # the cancel reached the engine
            pauses.pause()  # the gather ends; nothing is left to step

        _run(address, scenario)
    finally:
        loop.stop()
    assert tiny_bert_engine.core.num_steps == steps  # nothing ran
    assert loop.loop.admission.queued == 0 and not loop.loop.calls


def test_an_idle_engine_gathers_a_burst_into_one_step(
    tiny_bert_engine: vecpool.Engine, address: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Calls keep arriving (20 ms apart, or much more on a loaded machine) until the test
    # declares a pause: however long the gaps, the four are one burst.
    pauses = DeclaredPauses(monkeypatch)
    ctx = tiny_bert_engine.context
    loop = RunningLoop(tiny_bert_engine, address, batch_wait=60.0)
    steps = tiny_bert_engine.core.num_steps
    try:

        async def scenario(client: EngineProcessClient) -> None:
            burst = []
            for seed in range(4):
                requests = calls.make_requests(ctx, random_prompts(99, [5], seed), PoolingParams())
                burst.append(asyncio.ensure_future(client.run(requests)))
                await asyncio.sleep(0.02)
            await _until(lambda: loop.loop.admission.queued == 4)
            assert tiny_bert_engine.core.num_steps == steps  # still gathering
            pauses.pause()
            await asyncio.gather(*burst)
            assert tiny_bert_engine.core.num_steps == steps + 1  # the burst: one step
            # One call alone: the engine steps at a pause in arrivals, not after batch_wait
            # (60 s; the 30 s here only bound a failure).
            one = calls.make_requests(ctx, random_prompts(99, [6]), PoolingParams())
            await asyncio.wait_for(client.run(one), 30)

        _run(address, scenario)
    finally:
        loop.stop()
    assert tiny_bert_engine.core.num_steps == steps + 2
    # The gather waited in slices of GATHER_GAP (1 ms), the pause it ends at.
    assert set(pauses.gaps) == {math.ceil(engine_process.GATHER_GAP * 1000)}


def test_the_engine_exit_fails_calls_in_flight(
    tiny_bert_engine: vecpool.Engine, address: str
) -> None:
    alive, alive_writer = mp.Pipe(duplex=False)
    requests = calls.make_requests(
        tiny_bert_engine.context, random_prompts(99, [4]), PoolingParams()
    )

    async def main() -> None:
        client = EngineProcessClient(address, alive, max_queued=8)
        await client.start()
        try:
            call = asyncio.ensure_future(client.run(requests))  # no engine answers it
            await asyncio.sleep(0.05)
            assert client.is_running and not call.done()
            alive_writer.close()  # what the engine process's exit does
            with pytest.raises(EngineDeadError):
                await asyncio.wait_for(call, timeout=5)
            assert not client.is_running
            with pytest.raises(EngineDeadError):
                await client.run(requests)
        finally:
            await client.close()

    asyncio.run(main())


def test_a_stuck_engine_fails_the_health_check_and_a_live_one_passes(
    tiny_bert_engine: vecpool.Engine, address: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An engine whose process lives but does not answer (stopped, hung in a device call)
    fails the check; checks at once share one empty call; an engine that answers passes,
    and one heard from within HEALTH_FRESH is not asked. The engine is held while it must
    not answer (0.3 s of waiting then fails), and given 60 s (which only bound a failure)
    where it must."""
    monkeypatch.setattr(engine_client, "HEALTH_WAIT", 60.0)
    serving = RunningLoop(tiny_bert_engine, address)
    held, holding = threading.Event(), threading.Event()
    taken: list[int] = []  # the empty calls the engine took
    receive = serving.loop._receive

    def held_receive() -> bool:
        if held.is_set():
            holding.set()
            while held.is_set():
                time.sleep(0.005)
        return receive()

    submit = serving.loop._submit

    def counted_submit(identity: bytes, message: wire.Submit) -> bool:
        if not message.requests:
            taken.append(message.call_id)
        return submit(identity, message)

    monkeypatch.setattr(serving.loop, "_receive", held_receive)
    monkeypatch.setattr(serving.loop, "_submit", counted_submit)
    requests = calls.make_requests(
        tiny_bert_engine.context, random_prompts(99, [4]), PoolingParams()
    )

    async def main(client: EngineProcessClient) -> None:
        assert await client.health() is None  # never heard from: asked, and it answers
        assert len(taken) == 1
        assert await client.health() is None  # heard from just now: not asked
        assert len(taken) == 1
        monkeypatch.setattr(engine_client, "HEALTH_FRESH", 0.0)
        monkeypatch.setattr(engine_client, "HEALTH_WAIT", 0.3)
        held.set()
        problems = await asyncio.gather(client.health(), client.health(), client.health())
        assert holding.is_set()
        stuck = "the engine process did not answer within 0.3 s; it may be stuck"
        assert problems == [stuck] * 3
        monkeypatch.setattr(engine_client, "HEALTH_WAIT", 60.0)
        held.clear()
        assert await client.health() is None
        assert len(taken) == 3  # one question for the three checks, one after
        outputs = await client.run(requests)  # calls still run
        assert outputs[0].error is None

    try:
        _run(address, main)
    finally:
        held.clear()
        serving.stop()


def test_a_pooled_steps_replies_go_out_before_the_next_step_is_built(
    tiny_bert: tuple[Path, object], address: str
) -> None:
    # Three calls of two inputs, two inputs a step: the second step's forward is queued, the
    # first step pools behind it, and its call's reply is sent before the third step is
    # scheduled and built (not after, with the loop's own flush). Run-ahead on, as the loop
    # of a GPU engine runs (on the CPU it is off: the next test).
    engine = vecpool.Engine(tiny_bert[0], device="cpu", max_num_seqs=2)
    loop = EngineLoop(engine, EngineProcessConfig(address, 64, 0.0), metrics=None)
    assert not engine.core.run_ahead
    engine.core.run_ahead = True
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    try:
        dealer.connect(address)
        events: list[tuple[str, int]] = []
        flush, prepare = loop._flush, engine.core._prepare_next

        def logged_flush() -> None:
            events.append(("flush", sum(len(c) for c in loop.outbox.values())))
            flush()

        def logged_prepare():  # type: ignore[no-untyped-def]
            prepared = prepare()
            events.append(("prepare", 0 if prepared is None else len(prepared[0].requests)))
            return prepared

        loop._flush = logged_flush  # type: ignore[method-assign]
        engine.core._prepare_next = logged_prepare  # type: ignore[method-assign]
        for call_id in range(3):
            prompts = random_prompts(99, [4, 5], seed=70 + call_id)
            requests = [
                PromptRequest(i, Prompt(np.array(p), None), PoolingParams())
                for i, p in enumerate(prompts)
            ]
            dealer.send(wire.encoder.encode(wire.submit(call_id, requests)))
        deadline = time.monotonic() + 30
        while len(loop.calls) < 3:
            assert time.monotonic() < deadline
            loop._receive()
        while engine.core.has_work():
            loop._step()
            loop._flush()
        sent = [e for e in events if e != ("flush", 0)]  # flushes with replies to send
        assert sent[:4] == [("prepare", 2), ("prepare", 2), ("flush", 1), ("prepare", 2)]
        answered = []
        while len(answered) < 3:
            assert dealer.poll(30_000)
            answered += [c.call_id for c in wire.replies.decode(dealer.recv()).calls]
        assert answered == [0, 1, 2]
    finally:
        dealer.close(linger=0)
        loop.close()


def test_on_the_cpu_each_steps_replies_go_out_before_the_next_forward(
    tiny_bert: tuple[Path, object], address: str
) -> None:
    # On the CPU the forward has run when it returns: the loop pools and answers each step
    # before the next one's forward, rather than holding its replies behind that forward.
    # Three calls of two inputs, two inputs a step: forward, reply, three times over.
    engine = vecpool.Engine(tiny_bert[0], device="cpu", max_num_seqs=2)
    loop = EngineLoop(engine, EngineProcessConfig(address, 64, 0.0), metrics=None)
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    try:
        dealer.connect(address)
        events: list[str] = []
        flush, forward = loop._flush, engine.core.model_runner.forward

        def logged_flush() -> None:
            replies = sum(len(c) for c in loop.outbox.values())
            events.extend(["reply"] * replies)
            flush()

        def logged_forward(batch):  # type: ignore[no-untyped-def]
            events.append("forward")
            return forward(batch)

        loop._flush = logged_flush  # type: ignore[method-assign]
        engine.core.model_runner.forward = logged_forward  # type: ignore[method-assign]
        for call_id in range(3):
            prompts = random_prompts(99, [4, 5], seed=80 + call_id)
            requests = [
                PromptRequest(i, Prompt(np.array(p), None), PoolingParams())
                for i, p in enumerate(prompts)
            ]
            dealer.send(wire.encoder.encode(wire.submit(call_id, requests)))
        deadline = time.monotonic() + 30
        while len(loop.calls) < 3:
            assert time.monotonic() < deadline
            loop._receive()
        while engine.core.has_work():
            loop._step()
            loop._flush()
        assert events == ["forward", "reply"] * 3
        answered = []
        while len(answered) < 3:
            assert dealer.poll(30_000)
            answered += [c.call_id for c in wire.replies.decode(dealer.recv()).calls]
        assert answered == [0, 1, 2]
    finally:
        dealer.close(linger=0)
        loop.close()


def test_messages_carry_prompts_and_outputs_exactly() -> None:
    # The input stage's prompt embeds: a float array in the dtype it came in (the engine rounds
    # it to the model's dtype when it takes the request).
    embeds = np.random.default_rng(1).standard_normal((3, 8)).astype(np.float16)
    sent = [
        PromptRequest(
            0,
            Prompt(np.array([101, 7, 102]), None, np.array([0, 0, 1]), num_attended=2),
            PoolingParams(task="token_embed", dimensions=4),
        ),
        PromptRequest(1, Prompt(None, embeds), PoolingParams(task="token_embed", dimensions=4)),
        PromptRequest(2, Prompt(np.array([5, 6]), None), PoolingParams(task="embed")),
    ]
    message = wire.to_engine.decode(wire.encoder.encode(wire.submit(3, sent)))
    assert isinstance(message, wire.Submit) and message.call_id == 3
    got = wire.prompt_requests(message)
    assert [r.params for r in got] == [r.params for r in sent]
    assert len(message.params) == 2  # one entry per run of equal parameters
    assert np.array_equal(got[0].prompt.token_ids, [101, 7, 102])
    assert np.array_equal(got[0].prompt.token_type_ids, [0, 0, 1])
    assert got[0].prompt.num_attended == 2
    assert got[1].prompt.prompt_embeds is not None
    assert got[1].prompt.prompt_embeds.dtype == np.float16
    assert np.array_equal(got[1].prompt.prompt_embeds, embeds)

    data = np.random.default_rng(0).standard_normal((4, 3)).astype(np.float32)
    outputs = [
        PoolingOutput(0, data, None, 7),
        PoolingOutput(1, None, InputError("bad", index=1, field="prompt_embeds"), 3),
        PoolingOutput(2, None, RequestFailedError("failed alone", index=2), 2),
        PoolingOutput(3, None, EngineError("the step failed"), 2),
    ]
    done = wire.CallDone(3, [wire.wire_output(o) for o in outputs], 0.001, 0.002)
    back = wire.replies.decode(wire.encoder.encode(wire.Replies(5, [done])))
    assert back.queued == 5
    (reply,) = back.calls
    assert isinstance(reply, wire.CallDone)
    got_out = [wire.pooling_output(o) for o in reply.outputs]
    assert got_out[0].data is not None and np.array_equal(got_out[0].data, data)
    assert got_out[0].num_prompt_tokens == 7
    for original, copy in zip(outputs[1:], got_out[1:], strict=True):
        assert type(copy.error) is type(original.error)
        assert str(copy.error) == str(original.error)


def test_the_expected_wait_and_measured_speed_are_metrics() -> None:
    """What admission compares, on /metrics: set at each reply by the engine process, read at
    each scrape where the engine runs in the app's process."""
    from prometheus_client import CollectorRegistry

    from vecpool.api.admission import Admission
    from vecpool.server.metrics import EngineMetrics

    admission = Admission(max_queued=64, max_wait=1.0)
    admission.add(4, 600)
    for follow in (False, True):
        registry = CollectorRegistry()
        metrics = EngineMetrics(registry)
        admission.tokens_per_second = 1_000.0
        if follow:
            metrics.follow_admission(admission)
        else:
            metrics.set_admission(admission.expected_wait(), admission.tokens_per_second)

        def read(name: str) -> float | None:
            return registry.get_sample_value(name)  # noqa: B023 (read at once, in this pass)

        assert read("vecpool_engine_expected_wait_seconds") == 0.6
        assert read("vecpool_engine_measured_tokens_per_second") == 1_000.0
        admission.tokens_per_second = 2_000.0  # a scrape sees it; a set value waits for a reply
        assert read("vecpool_engine_expected_wait_seconds") == (0.3 if follow else 0.6)
