"""The engine loop: token budget, request cap, threads, strict loading, ST model folders."""

from __future__ import annotations

import json
import threading
from concurrent.futures import Future
from pathlib import Path
from typing import ClassVar

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from sentence_transformers import SentenceTransformer

import vecpool
from tests.conftest import make_st_folder
from tests.helpers import pipeline_chunks, random_prompts
from vecpool.config import SchedulerConfig
from vecpool.engine.request import Request
from vecpool.engine.scheduler import Scheduler
from vecpool.inputs.prompts import Prompt
from vecpool.tasks import TASKS, PoolingParams


def _request(n: int) -> Request:
    prompt = Prompt(token_ids=np.arange(n), prompt_embeds=None)
    return Request(f"r{n}", prompt, PoolingParams(), TASKS["embed"])


def test_scheduler_respects_budget_and_cap() -> None:
    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=20, max_num_seqs=3))
    for n in (8, 8, 5, 2, 2, 2, 9):
        scheduler.add(_request(n))
    steps = []
    while scheduler.has_work():
        out = scheduler.schedule().step
        steps.append([c.num_tokens for c in out.chunks])
        assert out.num_batched_tokens <= 20 and len(out.chunks) <= 3
        # Whole prompts: each chunk starts at 0 and runs the prompt to its end.
        assert all(c.start == 0 and c.num_tokens == c.prompt.num_tokens for c in out.chunks)
    assert steps == [[8, 8], [5, 2, 2], [2, 9]]


def test_small_budget_gives_the_same_results(tiny_bert) -> None:
    big = vecpool.Engine(tiny_bert[0], device="cpu")
    small = vecpool.Engine(tiny_bert[0], device="cpu", max_num_batched_tokens=64, max_num_seqs=2)
    prompts = random_prompts(99, [30, 5, 64, 17, 2, 41, 9], seed=11)
    before = small.core.num_steps
    a, b = big.embed(prompts), small.embed(prompts)
    assert small.core.num_steps - before >= 4
    assert np.abs(a - b).max() <= 1e-6


def test_encoder_prompt_over_the_budget_runs_alone(tiny_bert, monkeypatch) -> None:
    """Bidirectional attention cannot be chunked: a prompt longer than the budget (but within
    the model's 64) runs whole, alone in its own step, and gives what a larger budget gives."""
    big = vecpool.Engine(tiny_bert[0], device="cpu")
    small = vecpool.Engine(tiny_bert[0], device="cpu", max_num_batched_tokens=32)
    assert small.scheduler_config.max_cached_tokens == 0 and small.model_runner.kv_cache is None
    prompts = random_prompts(99, [5, 50, 7, 64, 3, 40], seed=12)
    steps: list[list[int]] = []
    original = small.model_runner.prepare

    def record(step):
        steps.append([c.num_tokens for c in step.chunks])
        return original(step)

    monkeypatch.setattr(small.model_runner, "prepare", record)
    assert np.abs(small.embed(prompts) - big.embed(prompts)).max() <= 1e-6
    # Longest first (one call's order): every over-budget prompt alone, then the rest.
    assert steps == [[64], [50], [40], [7, 5, 3]]


def test_concurrent_callers_share_the_engine(tiny_bert_engine: vecpool.Engine) -> None:
    engine = tiny_bert_engine
    groups = [random_prompts(99, [3 + i, 20 - i, 7], seed=20 + i) for i in range(6)]
    expected = [engine.embed(g) for g in groups]
    results: dict[int, np.ndarray] = {}
    errors: list[BaseException] = []

    def call(i: int) -> None:
        try:
            if i == 5:  # one caller sends a bad input; nobody else notices
                with pytest.raises(vecpool.InputError):
                    engine.embed([[1, 2], {"prompt_embeds": torch.zeros(2, 5)}])
            results[i] = engine.embed(groups[i])
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=call, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    for i in range(6):
        assert np.abs(results[i] - expected[i]).max() <= 1e-6


def test_engine_failure_fails_the_step_not_the_engine(tiny_bert_engine, monkeypatch) -> None:
    engine = tiny_bert_engine
    prompts = random_prompts(99, [4, 6], seed=30)
    expected = engine.embed(prompts)
    original = engine.model_runner.forward

    def broken(batch):
        raise RuntimeError("device fell over")

    monkeypatch.setattr(engine.model_runner, "forward", broken)
    with pytest.raises(vecpool.EngineError, match="device fell over"):
        engine.embed(prompts)
    monkeypatch.setattr(engine.model_runner, "forward", original)
    assert np.array_equal(engine.embed(prompts), expected)  # the same call: the same bits


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        ("drop", r"missing tensors for BertModel: encoder.layer.1.output.dense.weight"),
        (
            "extra",
            r"unexpected tensors for BertModel: encoder.layer.9.weight \(model.safetensors\)",
        ),
        (
            "shape",
            r"model.safetensors: tensor 'encoder.layer.0.intermediate.dense.bias' has shape \[5\], but BertModel expects \[37\]",
        ),
    ],
)
def test_loading_is_strict(tmp_path: Path, tiny_bert, edit: str, message: str) -> None:
    src = tiny_bert[0]
    for f in src.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    state = load_file(str(src / "model.safetensors"))
    if edit == "drop":
        del state["encoder.layer.1.output.dense.weight"]
    elif edit == "extra":
        state["encoder.layer.9.weight"] = torch.zeros(2)
    else:
        state["encoder.layer.0.intermediate.dense.bias"] = torch.zeros(5)
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(vecpool.ModelLoadError, match=message):
        vecpool.Engine(tmp_path, device="cpu")


def test_unknown_architecture_and_missing_folder(tmp_path: Path) -> None:
    with pytest.raises(vecpool.ModelLoadError, match="does not exist"):
        vecpool.Engine(tmp_path / "nope", device="cpu")
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["NoSuchModel"]}))
    with pytest.raises(vecpool.ConfigError, match="architecture 'NoSuchModel' is not supported"):
        vecpool.Engine(tmp_path, device="cpu")


SENTENCES = ["query: what is a pooling model?", "a cat sat on the mat", "vectors and scores"]


@pytest.mark.parametrize(
    ("pooling", "dense_out", "normalize"),
    [
        ("pooling_mode_cls_token", 24, False),
        ("pooling_mode_mean_tokens", None, True),
        ("pooling_mode_max_tokens", 16, True),
        ("pooling_mode_lasttoken", None, False),
        ("pooling_mode_mean_sqrt_len_tokens", 16, False),
        ("pooling_mode_weightedmean_tokens", None, True),
    ],
)
def test_sentence_transformers_folder_matches_reference(
    tmp_path: Path, default_model_dir: Path, pooling: str, dense_out, normalize: bool
) -> None:
    folder = make_st_folder(
        tmp_path / "st",
        default_model_dir,
        pooling=pooling,
        dense_out=dense_out,
        normalize=normalize,
    )
    ours = vecpool.Engine(folder, device="cpu").embed(SENTENCES)
    ref = SentenceTransformer(str(folder), device="cpu").encode(SENTENCES)
    assert ours.shape == ref.shape == (3, dense_out or 32)
    assert np.abs(ours - ref).max() < 1e-5
    norms = np.linalg.norm(ours, axis=1)
    assert np.allclose(norms, 1.0, atol=1e-6) == normalize


def test_instruction_prompts_by_name(tmp_path: Path, default_model_dir: Path) -> None:
    prompts = {"query": "query: ", "passage": "passage: "}
    folder = make_st_folder(
        tmp_path / "st", default_model_dir, prompts=prompts, default_prompt_name="query"
    )
    engine = vecpool.Engine(folder, device="cpu")
    st = SentenceTransformer(str(folder), device="cpu")
    texts = ["how do magnets work", "magnets attract iron"]
    default = engine.embed(texts)
    assert np.abs(default - st.encode(texts)).max() < 1e-5  # ST applies the default prompt too
    passage = engine.embed(texts, prompt_name="passage")
    assert np.abs(passage - st.encode(texts, prompt_name="passage")).max() < 1e-5
    # The same tokens in the same batch: the same computation, bit for bit.
    assert np.array_equal(engine.embed(texts, prompt="passage: "), passage)
    assert engine.tokenize("x", prompt_name="passage") == engine.tokenize("passage: x", prompt="")
    assert engine.tokenize("x") == engine.tokenize("query: x", prompt="")
    with pytest.raises(
        vecpool.InputError, match="unknown prompt name 'doc'; the model's prompts: passage, query"
    ):
        engine.embed(texts, prompt_name="doc")


def test_large_calls_are_pipelined_in_chunks(tiny_bert_engine, monkeypatch) -> None:
    engine = tiny_bert_engine
    prompts = random_prompts(99, [3 + (i * 7) % 40 for i in range(11)], seed=50)
    whole = engine.embed(prompts)
    sizes = pipeline_chunks(monkeypatch, first=2, chunk=3)
    assert np.abs(engine.embed(prompts) - whole).max() <= 1e-6
    assert sizes == [2, 3, 3, 3]  # a smaller first chunk: the device starts sooner
    # Matryoshka dimensions: each chunk's rows stacked into the call's result, cut alike.
    cut = engine.embed(prompts, dimensions=8)
    assert cut.shape == (len(prompts), 8)
    sizes.clear()
    assert (
        np.abs(cut - np.stack([engine.embed([p], dimensions=8)[0] for p in prompts])).max() <= 1e-6
    )
    assert sizes == [1] * len(prompts)  # (those calls were small: not chunked)
    per_token = engine.encode(prompts, task="token_embed")
    assert [t.shape[0] for t in per_token] == [len(p) for p in prompts]
    # A bad input in a later chunk is named by its index in the whole call, and the call's
    # requests still queued are dropped.
    bad = [*prompts[:7], [5, 999], *prompts[7:]]
    with pytest.raises(vecpool.InputError, match=r"input 7 \(prompt_token_ids\): token id 999"):
        engine.embed(bad)
    assert not engine.core.has_work()
    assert np.abs(engine.embed(prompts) - whole).max() <= 1e-6
    # A chunk is read as the call's inputs it holds: one of bare ints (not inputs) is refused
    # at the first of them, as a small call is, not read as one token-id prompt.
    ints = [*prompts[:2], 5, 6, 7, *prompts[2:]]
    small = r"input 2: unsupported input type int"
    with pytest.raises(vecpool.InputError, match=small):
        engine.embed(ints[:4])
    for run in (engine.embed, engine.encode):
        with pytest.raises(vecpool.InputError, match=small):
            run(ints)
    assert not engine.core.has_work()


def test_chunk_starts_by_count_and_by_weight(monkeypatch) -> None:
    monkeypatch.setattr(vecpool.api.running, "PIPELINE_CHUNK", 8)
    monkeypatch.setattr(vecpool.api.running, "PIPELINE_FIRST_CHUNK", 3)
    starts = vecpool.api.running.chunk_starts
    assert starts(8) == [0] and starts(0) == [0]
    assert starts(20) == [0, 3, 11, 19]
    assert starts(20, np.ones(20, dtype=np.int64)) == [0, 3, 11, 19]
    # An input heavier than a whole chunk is a chunk of its own; lighter ones fill up to it.
    weights = np.array([5, 1, 1, 9, 4, 4, 1, 2, 3], dtype=np.int64)
    assert starts(9, weights) == [0, 1, 3, 4, 6]
    assert starts(3, np.array([2, 2, 2], dtype=np.int64)) == [0]


class _LaterFuture(Future):  # type: ignore[type-arg]
    """A worker's result that reports itself ready only once `ready` is set."""

    ready = False

    def done(self) -> bool:
        return self.ready


class _GatedWorker:
    """Stands for the input worker thread of a large call: it prepares each chunk at once but
    reports it ready only once a step's forward has been queued after it was asked for, as a
    worker that tokenizes while the device computes (the timing made deterministic)."""

    pending: ClassVar[list[_LaterFuture]] = []

    def __init__(self, *args: object, **kwargs: object) -> None:
        _GatedWorker.pending = []

    def __enter__(self) -> _GatedWorker:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def submit(self, fn, *args):  # type: ignore[no-untyped-def]
        future = self.new_future()
        future.set_result(fn(*args))
        self.pending.append(future)
        return future

    def new_future(self) -> _LaterFuture:
        return _LaterFuture()


@pytest.mark.parametrize("first_alone", [False, True])
def test_a_chunk_prepared_during_a_step_joins_it_the_step_pools_behind_the_next_results_early(
    tiny_bert_engine, monkeypatch, first_alone: bool
) -> None:
    # Short inputs: each chunk of a large call fills a step of its own. The next chunk must
    # join the queue while a step's forward runs (not after it has pooled), so that the next
    # step is prepared and launched before this one pools: the host's pooling then overlaps
    # the device's forward (on CUDA; here the order is what is checked).
    engine = tiny_bert_engine
    prompts = random_prompts(99, [3 + (i * 7) % 40 for i in range(11)], seed=51)
    whole = engine.embed(prompts)
    monkeypatch.setattr(vecpool.api.running, "PIPELINE_CHUNK", 3)
    monkeypatch.setattr(vecpool.api.running, "PIPELINE_FIRST_CHUNK", 2)
    monkeypatch.setattr(vecpool.api.running, "ThreadPoolExecutor", _GatedWorker)
    monkeypatch.setattr(vecpool.api.running, "PIPELINE_FIRST_ALONE", first_alone)
    events: list[tuple[str, int]] = []
    forward, pool = engine.model_runner.forward, engine.core.pooling_runner.pool

    def logged_forward(batch):  # type: ignore[no-untyped-def]
        events.append(("forward", len(batch.has_token_ids)))
        for future in _GatedWorker.pending:
            future.ready = True
        return forward(batch)

    def logged_pool(hidden, batch, step, **kwargs):  # type: ignore[no-untyped-def]
        events.append(("pool", len(step.chunks)))
        return pool(hidden, batch, step, **kwargs)

    outcome = vecpool.api.running.outcome

    def logged_outcome(request):  # type: ignore[no-untyped-def]
        if not events or events[-1][0] != "take":
            events.append(("take", 0))
        events[-1] = ("take", events[-1][1] + 1)
        return outcome(request)

    monkeypatch.setattr(engine.model_runner, "forward", logged_forward)
    monkeypatch.setattr(engine.core.pooling_runner, "pool", logged_pool)
    monkeypatch.setattr(vecpool.api.running, "outcome", logged_outcome)
    got = engine.embed(prompts, show_progress=False)
    assert np.abs(got - whole).max() <= 1e-6
    # Chunks of 2, 3, 3, 3 inputs: each step pools after the next step's forward is queued,
    # and each chunk's results are taken once it has pooled, while later steps run (the last
    # step, with nothing behind it, pools at once: the last two chunks are taken together).
    # With `first_alone` the second chunk is asked for once the first step's forward is
    # queued, so in this model it is ready only after that step, which pools alone.
    first = [("pool", 2), ("take", 2), ("forward", 3)]
    if not first_alone:
        first = [("forward", 3), ("pool", 2), ("take", 2)]
    assert events == [
        ("forward", 2),
        *first,
        ("forward", 3),
        ("pool", 3),
        ("take", 3),
        ("forward", 3),
        ("pool", 3),
        ("pool", 3),
        ("take", 6),
    ]


class _LateWorker(_GatedWorker):
    """An input worker whose chunks are never ready before the engine asks for them (as a
    slow tokenizer's): records how many chunks were asked for and not yet taken, at each ask."""

    asks: ClassVar[list[int]] = []

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__()
        self.asked = 0
        _LateWorker.asks = []

    def new_future(self) -> _LaterFuture:
        worker = self
        worker.asked += 1
        _LateWorker.asks.append(worker.asked)

        class Taken(_LaterFuture):
            def result(self, timeout=None):  # type: ignore[no-untyped-def]
                worker.asked -= 1
                return super().result(timeout)

        return Taken()


def test_the_worker_prepares_two_chunks_ahead_once_the_engine_ran_dry_behind_one(
    tiny_bert_engine, monkeypatch
) -> None:
    engine = tiny_bert_engine
    prompts = random_prompts(99, [3 + (i * 7) % 40 for i in range(14)], seed=52)
    whole = engine.embed(prompts)
    monkeypatch.setattr(vecpool.api.running, "PIPELINE_CHUNK", 3)
    monkeypatch.setattr(vecpool.api.running, "PIPELINE_FIRST_CHUNK", 2)
    monkeypatch.setattr(vecpool.api.running, "ThreadPoolExecutor", _LateWorker)
    got = engine.embed(prompts, show_progress=False)
    assert np.abs(got - whole).max() <= 1e-6
    # Chunks of 2, 3, 3, 3, 3: each asked for once the one before it joined the queue, until
    # the engine has run dry behind a full chunk (the second): from then on two are asked for
    # ahead. (Chunks ready in time keep one at a time: the test above, whose worker reports
    # each chunk ready once a step's forward is queued, sees one forward per chunk.)
    assert vecpool.api.running.PIPELINE_AHEAD == 2
    assert _LateWorker.asks == [1, 1, 1, 1, 2]


def test_a_failing_input_is_isolated_from_its_step(tiny_bert_engine, monkeypatch) -> None:
    engine = tiny_bert_engine
    prompts = random_prompts(99, [5, 9, 3, 12, 7, 4], seed=60)
    prompts[3][2] = 77  # the model "crashes" on any batch holding token 77
    clean = [p for i, p in enumerate(prompts) if i != 3]
    expected = engine.embed(clean)
    original = engine.model_runner.forward

    def fragile(batch):
        if bool((batch.input_ids == 77).any()):
            raise RuntimeError("poisoned batch")
        return original(batch)

    monkeypatch.setattr(engine.model_runner, "forward", fragile)
    steps = engine.core.num_steps
    results = engine.pool(prompts, PoolingParams())
    assert engine.core.num_steps == steps + 1  # one scheduled step, re-run in halves inside it
    assert isinstance(results[3].error, vecpool.RequestFailedError)
    assert results[3].error.index == 3
    assert "the model failed on this input alone: RuntimeError: poisoned batch" in str(
        results[3].error
    )
    got = np.stack([r.data for i, r in enumerate(results) if i != 3])
    assert np.abs(got - expected).max() <= 1e-6
    with pytest.raises(vecpool.RequestFailedError, match=r"^input 3: the model failed"):
        engine.embed(prompts)
    assert np.abs(engine.embed(clean) - expected).max() <= 1e-6


def test_large_weights_load_with_a_progress_bar(tiny_bert, monkeypatch, capsys) -> None:
    import vecpool.models.loading.loader as loader

    vecpool.Engine(tiny_bert[0], device="cpu")
    assert "loading weights" not in capsys.readouterr().err  # small: no bar
    monkeypatch.setattr(loader, "PROGRESS_BYTES", 0)
    vecpool.Engine(tiny_bert[0], device="cpu")
    assert "loading weights" in capsys.readouterr().err
