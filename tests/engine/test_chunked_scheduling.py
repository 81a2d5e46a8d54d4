"""Scheduling prompts longer than the token budget: chunked prompts share steps with short
ones (neither holds the other back), the key/value cache is bounded, and whatever a chunked
prompt keeps between steps is released when it finishes, fails or is cancelled — measured in
the runners (entries and bytes), not assumed."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import vecpool
from tests.helpers import random_prompts, save_hf_model
from tests.models.test_decoders import ARCHS, VOCAB
from vecpool.api.args import EngineArgs
from vecpool.config import SchedulerConfig
from vecpool.engine.request import Request, RequestStatus
from vecpool.engine.scheduler import Scheduler
from vecpool.inputs.prompts import Prompt
from vecpool.tasks import TASKS, PoolingParams

# ---- the scheduler alone ----------------------------------------------------------------


def _request(name: str, n: int) -> Request:
    prompt = Prompt(token_ids=np.arange(n), prompt_embeds=None)
    return Request(name, prompt, PoolingParams(), TASKS["embed"])


def _tokens(scheduler: Scheduler) -> dict[str, int]:
    """The next step, as {request id: tokens}."""
    return {c.request_id: c.num_tokens for c in scheduler.schedule().step.chunks}


def test_waiting_prompts_get_half_the_budget_and_the_long_one_the_rest() -> None:
    scheduler = Scheduler(SchedulerConfig(20, 8, max_cached_tokens=200))
    long = _request("long", 100)
    scheduler.add(long)
    assert _tokens(scheduler) == {"long": 20}  # nothing else waits: the whole budget
    for i in range(5):
        scheduler.add(_request(f"s{i}", 4))
    # Waiting prompts take up to half the budget, whole; the long prompt what is left.
    assert _tokens(scheduler) == {"s0": 4, "s1": 4, "long": 12}
    assert _tokens(scheduler) == {"s2": 4, "s3": 4, "long": 12}
    assert _tokens(scheduler) == {"s4": 4, "long": 16}
    assert _tokens(scheduler) == {"long": 20}
    assert _tokens(scheduler) == {"long": 20}
    assert long.num_scheduled_tokens == 100 and _tokens(scheduler) == {}
    # Without a cache, prompts run whole: one over the budget alone in its own step.
    plain = Scheduler(SchedulerConfig(20, 8))
    for name, n in [("a", 5), ("b", 50), ("c", 3)]:
        plain.add(_request(name, n))
    assert [_tokens(plain) for _ in range(3)] == [{"a": 5}, {"b": 50}, {"c": 3}]


def test_a_prompt_waits_for_room_in_the_cache_while_short_ones_pass() -> None:
    scheduler = Scheduler(SchedulerConfig(20, 8, max_cached_tokens=150))
    first, second, short = _request("first", 100), _request("second", 100), _request("s", 3)
    for r in (first, second, short):
        scheduler.add(r)
    # The first starts; the second is held (100 + 100 > 150); the short one passes it.
    assert _tokens(scheduler) == {"s": 3, "first": 17}
    assert list(scheduler.held) == [second] and scheduler.num_reserved_tokens == 100
    while first.num_unscheduled_tokens:
        assert "second" not in _tokens(scheduler)
    assert _tokens(scheduler) == {}  # first is fully scheduled but not done: still reserved
    first.finish(np.zeros(1, dtype=np.float32))
    out = scheduler.schedule()
    assert out.released == ["first"]  # its runner state may go
    assert {c.request_id: c.num_tokens for c in out.step.chunks} == {"second": 20}


def test_a_cancelled_chunked_prompt_is_released_and_never_scheduled_again() -> None:
    scheduler = Scheduler(SchedulerConfig(20, 8, max_cached_tokens=200))
    long = _request("long", 100)
    scheduler.add(long)
    _tokens(scheduler)
    long.cancel()
    assert scheduler.has_work()  # until its release is handed out
    out = scheduler.schedule()
    assert out.released == ["long"] and out.is_empty and long.num_scheduled_tokens == 20
    assert not scheduler.has_work()


# ---- the engine -----------------------------------------------------------------------------

BUDGET = 16
LONG = 120


@pytest.fixture(scope="module")
def qwen3_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    arch = next(a for a in ARCHS if a.name == "qwen3")
    return save_hf_model(arch.hf_model(), tmp_path_factory.mktemp("qwen3_chunked"))


@pytest.fixture
def engine(qwen3_folder: Path) -> vecpool.Engine:
    return vecpool.Engine(qwen3_folder, device="cpu", max_num_batched_tokens=BUDGET)


def _submit(engine: vecpool.Engine, inputs: list[Any], **params: Any) -> list[Request]:
    requests = engine.make_requests(inputs, PoolingParams(**params))
    engine.core.add_requests(requests)
    return requests


def _held(engine: vecpool.Engine) -> tuple[int, int, int]:
    """(cache entries, cache bytes, pooling states) the runners keep between steps."""
    cache = engine.model_runner.kv_cache
    assert cache is not None
    return cache.num_entries, cache.num_bytes, engine.core.pooling_runner.num_states


def _drain(engine: vecpool.Engine) -> None:
    while engine.core.has_work():
        engine.core.step()


def test_short_requests_finish_while_a_long_prompt_is_chunking(engine: vecpool.Engine) -> None:
    core = engine.core
    done_at: dict[str, int] = {}

    def on_done(request: Request) -> None:
        done_at[request.request_id] = core.num_steps

    (long,) = _submit(engine, random_prompts(VOCAB, [LONG], seed=30))
    long.add_done_callback(on_done)
    core.step()
    shorts: list[tuple[Request, int]] = []
    for i in range(6):  # one short request per step, while the long prompt runs
        assert not long.is_done
        (short,) = _submit(engine, random_prompts(VOCAB, [5], seed=40 + i))
        short.add_done_callback(on_done)
        shorts.append((short, core.num_steps))
        core.step()
    _drain(engine)
    long_done = done_at[long.request_id]
    for short, submitted in shorts:
        # The step in flight when it came was built already: it runs in the one after.
        assert done_at[short.request_id] <= submitted + 2 < long_done
    assert long_done >= LONG // BUDGET + 1
    assert _held(engine) == (0, 0, 0)


def test_kept_keys_and_values_are_released_after_completion(engine: vecpool.Engine) -> None:
    (long,) = _submit(engine, random_prompts(VOCAB, [LONG], seed=31))
    engine.core.step()
    engine.core.step()
    layers, kv_heads, head_dim = 3, 2, 16  # the qwen3 test config
    # One prompt in flight: its whole length reserved, per layer, keys and values, float32.
    assert _held(engine) == (1, layers * 2 * LONG * kv_heads * head_dim * 4, 1)
    _drain(engine)
    assert long.status == RequestStatus.FINISHED
    assert _held(engine) == (0, 0, 0)


def test_kept_state_is_released_after_a_failure(
    engine: vecpool.Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    prompts = random_prompts(VOCAB, [LONG, 4], seed=32)
    expected = engine.embed(prompts)
    original = engine.model_runner.forward

    def fails_late(batch: Any) -> Any:
        if int(batch.positions.max()) >= 60:  # the long prompt's fifth chunk
            raise RuntimeError("device fell over")
        return original(batch)

    monkeypatch.setattr(engine.model_runner, "forward", fails_late)
    long, short = _submit(engine, prompts)
    _drain(engine)
    assert long.status == RequestStatus.FAILED and "device fell over" in str(long.error)
    assert short.status == RequestStatus.FINISHED
    assert _held(engine) == (0, 0, 0)
    monkeypatch.setattr(engine.model_runner, "forward", original)
    assert np.abs(engine.embed(prompts) - expected).max() <= 1e-6  # the engine goes on
    # A request that fails in pooling (its task needs token ids it did not come with).
    embeds = {"prompt_embeds": engine.embed_tokens(prompts[0])}
    (tagged,) = _submit(engine, [embeds], task="token_embed", step_tag_id=3)
    _drain(engine)
    assert tagged.status == RequestStatus.FAILED and "needs token ids" in str(tagged.error)
    assert _held(engine) == (0, 0, 0)


def test_kept_state_is_released_after_cancellation(engine: vecpool.Engine) -> None:
    core = engine.core
    for steps_before in (3, 1):  # 1: its next chunk is already built when it is cancelled
        (long,) = _submit(engine, random_prompts(VOCAB, [LONG], seed=33))
        for _ in range(steps_before):
            core.step()
        assert _held(engine)[0] == 1
        long.cancel()
        scheduled = long.num_scheduled_tokens
        _drain(engine)
        assert long.status == RequestStatus.CANCELLED
        assert long.num_scheduled_tokens == scheduled  # nothing more was scheduled
        assert long.num_computed_tokens <= steps_before * BUDGET  # nor run
        assert _held(engine) == (0, 0, 0)


def test_encoder_prompt_too_large_for_memory_names_what_to_configure(
    tiny_bert: tuple[Path, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = vecpool.Engine(tiny_bert[0], device="cpu", max_num_batched_tokens=32)
    original = engine.model_runner.forward

    def out_of_memory(batch: Any) -> Any:
        if batch.num_tokens > 32:
            raise RuntimeError("out of memory")
        return original(batch)

    monkeypatch.setattr(engine.model_runner, "forward", out_of_memory)
    results = engine.pool(random_prompts(99, [50, 5], seed=34), PoolingParams())
    assert results[1].error is None
    error = results[0].error
    assert isinstance(error, vecpool.RequestFailedError)
    assert "this input of 50 tokens ran alone in a step over the token budget " in str(error)
    assert "(max_num_batched_tokens=32)" in str(error) and "truncate_prompt_tokens" in str(error)


def test_cache_options(qwen3_folder: Path) -> None:
    with pytest.raises(
        vecpool.ConfigError, match="max_cached_tokens=100 is below max_model_len=128"
    ):
        vecpool.Engine(qwen3_folder, device="cpu", max_num_batched_tokens=16, max_cached_tokens=100)
    # Decoders keep their default budget (no longer raised to the model's length); the cache
    # holds one prompt of the model's length by default.
    default = vecpool.Engine(qwen3_folder, device="cpu", max_num_batched_tokens=16)
    assert default.scheduler_config.max_cached_tokens == 128
    # 0: no chunking; a prompt over the budget runs whole, alone, as an encoder's does.
    whole = vecpool.Engine(
        qwen3_folder, device="cpu", max_num_batched_tokens=16, max_cached_tokens=0
    )
    assert whole.scheduler_config == SchedulerConfig(16, 256, max_cached_tokens=0)
    prompts = random_prompts(VOCAB, [LONG, 3], seed=35)
    before = whole.core.num_steps
    assert np.abs(whole.embed(prompts) - default.embed(prompts)).max() <= 1e-5
    assert whole.core.num_steps - before == 2
    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    args = EngineArgs.from_cli_args(
        parser.parse_args(
            ["--max-cached-tokens", "0", "--windowed-embed", "--embed-window-overlap", "4"]
        )
    )
    assert (args.max_cached_tokens, args.windowed_embed, args.embed_window_overlap) == (0, True, 4)
