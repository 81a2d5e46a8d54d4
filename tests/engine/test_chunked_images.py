"""Vision-language prompts that run in chunks under a patch budget: the scheduler's steps (which
chunk of which prompt, how many patch rows its vision tower runs) read from its own output, then
tiny Qwen2-VL / Qwen2.5-VL engines whose chunk boundaries split image spans.

Tolerance: 1e-5 of the largest output (`assert_rel_close`), fp32 on the CPU, as the chunked
text tests (tests/engine/test_chunked_scheduling.py, tests/models/test_chunked_prefill.py):
a chunk's attention reads the cached keys of the chunks before it, the same arithmetic in
other kernel shapes; a wrong position, row or image moves the outputs by 1e-2 or more. The
tower's runs are counted (its patch rows), not inferred from timing.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

import vecpool
from tests.helpers import assert_rel_close
from tests.models.test_qwen2_vl import (
    IMAGE,
    reference,
    sample_images,
    save_tiny_qwen2_vl,
    user,
)
from vecpool.config import SchedulerConfig
from vecpool.engine.request import Request, RequestStatus
from vecpool.engine.scheduler import Scheduler
from vecpool.inputs.pixels import ImagePixels, ImageSpan
from vecpool.inputs.prompts import Prompt
from vecpool.runner.step import StepInput
from vecpool.tasks import TASKS, PoolingParams

# ---- the scheduler alone ----------------------------------------------------------------


def _prompt(n: int, images: list[tuple[int, int, int]]) -> Prompt:
    """`n` token ids with images given as (first placeholder, placeholders, patch rows)."""
    spans = tuple(
        ImageSpan(start, count, (p, 1), ImagePixels(np.zeros((p, 1), np.float32), (p, 1)))
        for start, count, p in images
    )
    return Prompt(token_ids=np.zeros(n, dtype=np.int64), prompt_embeds=None, images=spans)


def _request(name: str, n: int, images: list[tuple[int, int, int]] | None = None) -> Request:
    return Request(name, _prompt(n, images or []), PoolingParams(), TASKS["embed"])


def _step(scheduler: Scheduler) -> dict[str, tuple[int, int, int]]:
    """The next step, as {request id: (first position, tokens, patch rows)}."""
    step = scheduler.schedule().step
    return {c.request_id: (c.start, c.num_tokens, c.patches) for c in step.chunks}


def test_a_chunk_ends_before_an_image_the_step_has_no_patches_for() -> None:
    scheduler = Scheduler(SchedulerConfig(16, 8, max_cached_tokens=200, max_num_batched_patches=64))
    # Two images of 40 patches whose spans begin in the first 16 tokens; a third at 40.
    page = _request("page", 60, [(4, 4, 40), (10, 4, 40), (40, 10, 60)])
    scheduler.add(page)
    steps = [_step(scheduler) for _ in range(5)]
    assert steps == [
        {"page": (0, 10, 40)},  # the second image does not fit: the chunk ends before it
        {"page": (10, 16, 40)},
        {"page": (26, 16, 60)},  # the third image's span goes on into the next chunk
        {"page": (42, 16, 0)},
        {"page": (58, 2, 0)},
    ]
    assert _step(scheduler) == {}
    # Every image's patches charged once, in the step that reaches its first placeholder.
    assert sum(p for s in steps for _, _, p in s.values()) == page.prompt.num_patches == 140


def test_short_queries_are_not_stalled_behind_a_page_image() -> None:
    scheduler = Scheduler(SchedulerConfig(16, 8, max_cached_tokens=400, max_num_batched_patches=64))
    # A page: an image of 40 patches every 20 positions.
    page = _request("page", 200, [(2 + 20 * k, 10, 40) for k in range(9)])
    scheduler.add(page)
    assert _step(scheduler) == {"page": (0, 16, 40)}
    records = []
    for i in range(6):  # a text query, and a small image query, arrive at every step
        scheduler.add(_request(f"q{i}", 3))
        scheduler.add(_request(f"img{i}", 5, [(1, 2, 20)]))
        records.append(_step(scheduler))
    for i, step in enumerate(records):
        # Both queries run in the very next step, whole, beside a chunk of the page, within
        # the budgets: the page's next image keeps its share of the patches.
        assert step[f"q{i}"] == (0, 3, 0) and step[f"img{i}"] == (0, 5, 20)
        assert step["page"][1] > 0
        assert sum(t for _, t, _ in step.values()) <= 16
        assert sum(p for _, _, p in step.values()) <= 64
    for _ in range(20):  # the rest of the page, its images within the budget
        assert scheduler.schedule().step.num_batched_patches <= 64
    assert page.num_unscheduled_tokens == 0


def test_an_image_over_the_whole_patch_budget_runs_where_the_tower_runs_no_other() -> None:
    config = SchedulerConfig(16, 8, max_cached_tokens=200, max_num_batched_patches=64)
    scheduler = Scheduler(config)
    page = _request("page", 40, [(20, 10, 100)])  # 100 patches: over the budget
    scheduler.add(page)
    scheduler.add(_request("small", 4, [(1, 2, 20)]))
    assert _step(scheduler) == {"small": (0, 4, 20), "page": (0, 12, 0)}
    scheduler.add(_request("later", 4, [(1, 2, 20)]))
    # The page's next image is over the budget: waiting images give it the whole step's tower.
    assert _step(scheduler) == {"page": (12, 16, 100)}
    assert _step(scheduler) == {"later": (0, 4, 20), "page": (28, 12, 0)}
    # Without a cache the prompt runs whole: in a step whose tower runs nothing else, with
    # texts beside it, after the image prompt ahead of it.
    whole = Scheduler(SchedulerConfig(64, 8, max_num_batched_patches=64))
    for name, n, images in [
        ("before", 4, [(1, 2, 30)]),
        ("big", 40, [(20, 10, 100)]),
        ("text", 5, []),
        ("after", 4, [(1, 2, 30)]),
    ]:
        whole.add(_request(name, n, images))
    assert [_step(whole) for _ in range(3)] == [
        {"before": (0, 4, 30)},
        {"big": (0, 40, 100), "text": (0, 5, 0)},
        {"after": (0, 4, 30)},
    ]


def test_the_patch_budget_is_an_option() -> None:
    assert SchedulerConfig(100).patch_budget == 100  # default: the token budget
    with pytest.raises(vecpool.ConfigError, match="max_num_batched_patches must be positive"):
        vecpool.EngineArgs(max_num_batched_patches=0)
    args = vecpool.EngineArgs(max_num_batched_tokens=128, max_num_batched_patches=512)
    config = args.scheduler_config(torch.device("cpu"), 256, causal=True)
    assert (config.max_num_batched_tokens, config.patch_budget) == (128, 512)


# ---- the engine -----------------------------------------------------------------------------

BUDGET, PATCHES = 16, 96


@pytest.fixture(scope="module", params=[False, True], ids=["qwen2_vl", "qwen2_5_vl"])
def vlm(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """(an engine that runs its prompts whole, one that chunks them under small budgets, the
    transformers model, the folder)."""
    path = tmp_path_factory.mktemp("chunked_vl") / "model"
    hf = save_tiny_qwen2_vl(path, request.param)
    whole = vecpool.Engine(path, device="cpu", normalize=False)
    chunked = vecpool.Engine(
        path,
        device="cpu",
        normalize=False,
        max_num_batched_tokens=BUDGET,
        max_num_batched_patches=PATCHES,
    )
    return whole, chunked, hf, path


class TowerCount:
    """Patch rows the vision tower ran, and each step's chunks."""

    def __init__(self, engine: vecpool.Engine, monkeypatch: pytest.MonkeyPatch) -> None:
        self.patches = 0
        self.steps: list[StepInput] = []
        runner = engine.model_runner
        visual: Any = runner.model.visual
        tower, prepare = visual.forward, runner.prepare

        def counted_tower(pixel_values: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            self.patches += int(pixel_values.shape[0])
            return tower(pixel_values, *args, **kwargs)

        def recorded(step: StepInput) -> Any:
            self.steps.append(step)
            return prepare(step)

        monkeypatch.setattr(visual, "forward", counted_tower)
        monkeypatch.setattr(runner, "prepare", recorded)


def _page_inputs() -> tuple[list[Any], list[str], list[list[Any]]]:
    """A long prompt with two images (16 and 20 placeholders, 64 and 80 patch rows), a short
    image query (4 placeholders, 16 patch rows) and a text: inputs, and their texts and
    images for the reference."""
    a, b, c = sample_images([(64, 64), (64, 56), (16, 16)], seed=7)
    page = user(f"a photo {IMAGE} of the red house on {IMAGE} the cat on the dog")
    query = f"{IMAGE} a cat"
    inputs = [{"prompt": page, "image": [a, b]}, {"prompt": query, "image": c}, "a red dog"]
    return inputs, [page, query, "a red dog"], [[a, b], [c], []]


def test_chunked_images_equal_the_whole_run_and_transformers(
    vlm: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    whole, chunked, hf, path = vlm
    inputs, texts, images = _page_inputs()
    expected = np.stack([reference(hf, path, t, i) for t, i in zip(texts, images, strict=True)])
    out_whole = whole.embed(inputs)
    count = TowerCount(chunked, monkeypatch)
    out = chunked.embed(inputs)
    assert_rel_close(out, out_whole)
    assert_rel_close(out, expected)
    # The page's prompt ran in chunks, and a chunk boundary split an image's span.
    page = [c for s in count.steps for c in s.chunks if c.prompt.num_tokens > 40]
    assert len(page) > 2 and page[0].start == 0
    bounds = {c.start for c in page[1:]}
    assert any(s.start < b < s.end for s in page[0].prompt.images for b in bounds)
    # Each image ran through the tower once, and no step's tower ran more than its budget.
    processor = chunked.inputs.images.processor
    assert count.patches == sum(processor(i).num_patches for i in images[0] + images[1])
    assert all(s.num_batched_patches <= PATCHES for s in count.steps)
    assert chunked.model_runner.kept_image_rows.num_entries == 0  # freed after the last chunk


def test_a_mixed_batch_equals_each_input_alone(vlm: Any) -> None:
    _, chunked, _, _ = vlm
    inputs, texts, images = _page_inputs()
    inputs += ["the house", {"text": "a dog", "image": sample_images([(21, 50)], seed=8)[0]}]
    # The page again, its first image's rows given (the tower's, computed before): the chunks
    # that split its span take their slices of them.
    pixels = chunked.inputs.images.processor(images[0][0])
    given = {
        "image_embeds": chunked.model_runner.image_rows(pixels),
        "image_grid_thw": [1, *pixels.grid],
    }
    inputs.append({"prompt": texts[0], "image": [given, images[0][1]]})
    together = chunked.embed(inputs)
    for item, row in zip(inputs, together, strict=True):
        assert_rel_close(chunked.embed([item])[0], row)
    assert_rel_close(together[-1], together[0])


def _submit(engine: vecpool.Engine, inputs: list[Any]) -> list[Request]:
    requests = engine.make_requests(inputs, PoolingParams())
    engine.core.add_requests(requests)
    return requests


def _drain(engine: vecpool.Engine) -> None:
    while engine.core.has_work():
        engine.core.step()


def test_a_short_query_finishes_while_the_page_is_chunking(vlm: Any) -> None:
    _, chunked, _, _ = vlm
    core = chunked.core
    inputs, _, _ = _page_inputs()
    done_at: dict[str, int] = {}

    def on_done(request: Request) -> None:
        done_at[request.request_id] = core.num_steps

    (page,) = _submit(chunked, inputs[:1])
    page.add_done_callback(on_done)
    core.step()
    queries = []
    for item in inputs[1:]:  # an image query, then a text, one step apart
        assert not page.is_done
        (query,) = _submit(chunked, [item])
        query.add_done_callback(on_done)
        queries.append((query, core.num_steps))
        core.step()
    _drain(chunked)
    for query, submitted in queries:
        # The step in flight when it came was built already: it runs in the one after.
        assert done_at[query.request_id] <= submitted + 2 < done_at[page.request_id]
    assert chunked.model_runner.kept_image_rows.num_entries == 0


def test_kept_image_rows_are_freed_on_failure_and_cancellation(
    vlm: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, chunked, _, _ = vlm
    core, kept = chunked.core, chunked.model_runner.kept_image_rows
    inputs, _, _ = _page_inputs()
    hidden = chunked.model_runner.model.hidden_size
    # Cancelled while an image's rows are kept: freed.
    (page,) = _submit(chunked, inputs[:1])
    while kept.num_entries == 0:
        core.step()
    assert kept.num_bytes == kept.num_entries * 16 * hidden * 4  # an image's 16 rows, fp32
    page.cancel()
    _drain(chunked)
    assert page.status == RequestStatus.CANCELLED and kept.num_entries == 0
    # A forward that fails after an image's rows were kept: the page fails alone, freed.
    original = chunked.model_runner.forward

    def fails_late(batch: Any) -> Any:
        if kept.num_entries and int(batch.positions.max()) >= 40:
            raise RuntimeError("device fell over")
        return original(batch)

    monkeypatch.setattr(chunked.model_runner, "forward", fails_late)
    page, query = _submit(chunked, inputs[:2])
    _drain(chunked)
    assert page.status == RequestStatus.FAILED and "device fell over" in str(page.error)
    assert query.status == RequestStatus.FINISHED
    cache = chunked.model_runner.kv_cache
    assert kept.num_entries == 0 and cache is not None and cache.num_entries == 0


def test_an_image_over_the_patch_budget_runs_alone_or_fails_alone_named(
    vlm: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    whole, _, _, path = vlm
    small = vecpool.Engine(
        path,
        device="cpu",
        normalize=False,
        max_num_batched_tokens=BUDGET,
        max_num_batched_patches=32,
    )
    inputs, _, _ = _page_inputs()  # the page's images: 64 and 80 patch rows, both over 32
    count = TowerCount(small, monkeypatch)
    assert_rel_close(small.embed(inputs), whole.embed(inputs))
    # Each of the page's images ran in a step whose tower ran nothing else.
    big = [s for s in count.steps if s.num_batched_patches > 32]
    assert sorted(s.num_batched_patches for s in big) == [64, 80]
    assert all(sum(c.patches > 0 for c in s.chunks) == 1 for s in big)
    assert count.patches == 64 + 80 + 16
    # Such a step fails: the page fails alone, naming the budget; the others are served.
    original = small.model_runner.forward

    def out_of_memory(batch: Any) -> Any:
        rows = batch.image_rows
        if rows is not None and rows.images is not None and rows.images.pixel_values.shape[0] > 32:
            raise RuntimeError("out of memory")
        return original(batch)

    monkeypatch.setattr(small.model_runner, "forward", out_of_memory)
    results = small.pool(inputs, PoolingParams())
    assert [r.error is None for r in results] == [False, True, True]
    error = results[0].error
    assert isinstance(error, vecpool.RequestFailedError) and "out of memory" in str(error)
    assert "64 patch rows" in str(error) and "max_num_batched_patches=32" in str(error)
    assert small.model_runner.kept_image_rows.num_entries == 0
