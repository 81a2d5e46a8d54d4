"""Tasks sharing batches: every request gets what it gets alone; prompt embeds serve every task
that does not need token ids; parameters a task does not accept are refused."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import transformers

import vecpool
from tests.helpers import REORDERED_RTOL, assert_rel_close, save_hf_model
from tests.tasks.conftest import tiny_bert_head
from vecpool.engine.request import Request
from vecpool.tasks import TASKS, PoolingParams

TAG = 42


@pytest.fixture(scope="module")
def classifier_engine(tmp_path_factory: pytest.TempPathFactory) -> vecpool.Engine:
    """A BertForSequenceClassification (3 labels): embed, classify, score, token_embed (the
    embedding tasks asked for: a classifier is not made for them)."""
    hf = tiny_bert_head(transformers.BertForSequenceClassification, num_labels=3)
    folder = save_hf_model(hf, tmp_path_factory.mktemp("cls"))
    return vecpool.Engine(folder, device="cpu", tasks=("embed", "token_embed"))


def _run_together(engine: vecpool.Engine, groups: list[list[Request]]) -> None:
    steps = engine.core.num_steps
    for request in [r for g in groups for r in g]:
        engine.core.add_requests([request])
    engine.core.run_until_done([r for g in groups for r in g])
    assert engine.core.num_steps == steps + 1  # one engine step served every task


def _outputs(requests: list[Request]) -> list[np.ndarray]:
    assert all(r.error is None and r.output is not None for r in requests)
    return [r.output for r in requests if r.output is not None]


def _assert_same(mixed: list[np.ndarray], alone: list[np.ndarray]) -> None:
    # Mixed, the batch holds three times the rows: matmuls of other shapes, so the same
    # values up to reordered fp32 sums.
    for a, b in zip(mixed, alone, strict=True):
        assert_rel_close(a, b, rtol=REORDERED_RTOL)


@pytest.mark.parametrize("engine_name", ["classifier_engine", "splade_engine"])
def test_mixed_tasks_give_what_each_gives_alone(
    engine_name: str, request: pytest.FixtureRequest
) -> None:
    engine: vecpool.Engine = request.getfixturevalue(engine_name)
    prompts = [[101, 7, 2000 + i, 3000 + 2 * i, 102][: 3 + i % 3] for i in range(6)]
    second = "classify" if engine_name == "classifier_engine" else "sparse"
    tasks = ["embed", second, "token_embed"]
    alone = [engine.encode(prompts, task=t) for t in tasks]
    groups = [engine.make_requests(prompts, PoolingParams(task=t)) for t in tasks]
    _run_together(engine, groups)
    for group, expected in zip(groups, alone, strict=True):
        _assert_same(_outputs(group), expected)


# (task, params, engine): every task that does not need token ids
EMBEDS_SERVED = [
    ("embed", {}, "classifier_engine"),
    ("classify", {}, "classifier_engine"),
    ("score", {}, "classifier_engine"),
    ("token_embed", {}, "classifier_engine"),
    ("token_classify", {}, "token_classifier_engine"),
    ("sparse", {}, "splade_engine"),
    ("sparse", {"exclude_special_tokens": False}, "splade_engine"),
]
EMBEDS_REFUSED = [
    ("sparse", {"exclude_special_tokens": True}, "splade_engine"),
    ("token_embed", {"step_tag_id": TAG}, "classifier_engine"),
    ("token_classify", {"step_tag_id": TAG}, "token_classifier_engine"),
]


@pytest.fixture(scope="module")
def token_classifier_engine(tmp_path_factory: pytest.TempPathFactory) -> vecpool.Engine:
    hf = tiny_bert_head(transformers.BertForTokenClassification, num_labels=4)
    return vecpool.Engine(save_hf_model(hf, tmp_path_factory.mktemp("tok")), device="cpu")


@pytest.mark.parametrize(("task", "params", "engine_name"), EMBEDS_SERVED)
def test_prompt_embeds_serve_tasks_without_token_ids(
    task: str, params: dict[str, Any], engine_name: str, request: pytest.FixtureRequest
) -> None:
    engine: vecpool.Engine = request.getfixturevalue(engine_name)
    prompts = [[101, 5, TAG, 9, 102], [101, 300, 400, 102], [101, TAG, 102]]
    pooling = PoolingParams(task=task, **params)
    as_ids = engine.pool(prompts, pooling)
    embeds = [{"prompt_embeds": engine.embed_tokens(p)} for p in prompts]
    mixed = engine.pool([embeds[0], prompts[1], embeds[2]], pooling)
    for a, b in zip(as_ids, mixed, strict=True):
        assert a.error is None and b.error is None
        # Bit-exact by construction: the embeds are the model's own lookup, written into the
        # rows the ids would fill, so the forward and the heads are the same computation.
        assert np.array_equal(a.data, b.data)


@pytest.mark.parametrize(("task", "params", "engine_name"), EMBEDS_REFUSED)
def test_prompt_embeds_fail_alone_for_tasks_needing_token_ids(
    task: str, params: dict[str, Any], engine_name: str, request: pytest.FixtureRequest
) -> None:
    engine: vecpool.Engine = request.getfixturevalue(engine_name)
    prompts = [[101, 5, TAG, 9, 102], [101, 300, TAG, 102], [101, TAG, 102]]
    pooling = PoolingParams(task=task, **params)
    expected = engine.pool(prompts, pooling)
    results = engine.pool(
        [prompts[0], {"prompt_embeds": engine.embed_tokens(prompts[1])}, prompts[2]], pooling
    )
    assert isinstance(results[1].error, vecpool.RequestFailedError)
    assert results[1].error.index == 1 and "needs token ids" in str(results[1].error)
    for i in (0, 2):  # heads on fewer rows: the same up to matmul blocking
        assert results[i].error is None
        assert np.abs(results[i].data - expected[i].data).max() <= 1e-6


@pytest.mark.parametrize(
    ("task", "param", "value"),
    [
        (task, param, value)
        for task, spec in TASKS.items()
        for param, value in [
            ("dimensions", 8),
            ("normalize", False),
            ("step_tag_id", TAG),
            ("use_activation", False),
            ("exclude_special_tokens", True),
        ]
        if param not in spec.accepted_params
    ],
)
def test_parameters_a_task_does_not_accept_are_refused(
    classifier_engine: vecpool.Engine, task: str, param: str, value: Any
) -> None:
    with pytest.raises(
        vecpool.InputError, match=rf"task '{task}' does not accept parameter '{param}'"
    ):
        classifier_engine.pool([[101, 5, 102]], PoolingParams(task=task, **{param: value}))


def test_dimensions_are_checked_per_task(
    classifier_engine: vecpool.Engine, colbert: tuple[Path, Any, Any]
) -> None:
    with pytest.raises(vecpool.InputError, match="between 1 and the model's output size 32"):
        classifier_engine.embed([[101, 5, 102]], dimensions=33)
    colbert_engine = vecpool.Engine(colbert[0], device="cpu")
    (cut,) = colbert_engine.encode(["cats eat fish"], task="token_embed", dimensions=8)
    assert cut.shape[1] == 8
    with pytest.raises(vecpool.InputError, match="output size 16"):
        colbert_engine.encode(["cats"], task="token_embed", dimensions=20)
    (embedding,) = colbert_engine.embed(["cats eat fish"], dimensions=20)  # embed: 32 wide
    assert embedding.shape == (20,)
