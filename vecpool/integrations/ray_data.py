"""Ray Data: embed, classify or score a column of a `ray.data.Dataset` with `map_batches` over a
pool of vecpool engine actors, one engine per actor. Rows keep their order and their other
columns; the result is a new column.

    import ray, vecpool.ray
    from vecpool import EngineArgs

    ds = ray.data.read_parquet("s3://bucket/corpus/")
    ds = vecpool.ray.embed(ds, "text", engine_args=EngineArgs("path/to/model"),
                           concurrency=8, num_gpus=1, batch_size=1024)
    ds.write_parquet("s3://bucket/vectors/")

A column may hold texts, token ids (a list of ints per row) or prompt embeddings (a
`[num_tokens, hidden_size]` array per row), mixed freely.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import ray.data

from vecpool.api import Engine, EngineArgs
from vecpool.calls import ClassifyOptions, EmbedOptions, Options, ScoreOptions
from vecpool.errors import InputError

DEFAULT_BATCH_SIZE = 256
_TASKS = ("embed", "classify", "score")


class EngineActor:
    """What each Ray actor runs: one engine, applied to one batch (a dict of numpy columns) at a
    time; the batch comes back with `output_column` added. `options`: the task's options, given
    to its `Engine` method."""

    def __init__(
        self,
        engine_args: EngineArgs,
        task: str,
        columns: tuple[str, ...],
        output_column: str,
        options: Options,
    ):
        if task not in _TASKS:
            raise ValueError(f"task {task!r} is not one of {_TASKS}")
        self.engine = Engine.from_args(engine_args)
        self.task = task
        self.columns = columns
        self.output_column = output_column
        self.options = options

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        sides = [
            [_as_input(v, column, i) for i, v in enumerate(batch[column])]
            for column in self.columns
        ]
        opts = {**self.options.keywords(), "show_progress": False}
        if self.task == "embed":
            result = self.engine.embed(sides[0], **opts)
        elif self.task == "classify":
            result = self.engine.classify(sides[0], **opts)
        else:  # two equally long lists score pairwise
            result = self.engine.score(sides[0], sides[1], **opts)
        return {**batch, self.output_column: result}


def embed(
    ds: ray.data.Dataset,
    column: str = "text",
    *,
    output_column: str = "embedding",
    engine_args: EngineArgs | None = None,
    dimensions: int | None = None,
    normalize: bool | None = None,
    truncate_prompt_tokens: int | None = None,
    prompt_name: str | None = None,
    **pool: Any,
) -> ray.data.Dataset:
    """`ds` with `output_column`: each row's vector of `column` (float32 `[dim]`).

    `pool` sets the actor pool: `concurrency` (actors, or `(min, max)` to autoscale; default
    1), `num_gpus` / `num_cpus` per actor, `batch_size` (rows per call; default 256),
    `preserve_order` (default True: Ray Data keeps the rows' order) and any other
    `map_batches` argument (e.g. `compute`, `memory`, `runtime_env`)."""
    options = EmbedOptions(
        dimensions=dimensions,
        normalize=normalize,
        truncate_prompt_tokens=truncate_prompt_tokens,
        prompt_name=prompt_name,
    )
    return _map(ds, "embed", (column,), output_column, engine_args, options, pool)


def classify(
    ds: ray.data.Dataset,
    column: str = "text",
    *,
    output_column: str = "probs",
    engine_args: EngineArgs | None = None,
    use_activation: bool | None = None,
    truncate_prompt_tokens: int | None = None,
    **pool: Any,
) -> ray.data.Dataset:
    """`ds` with `output_column`: each row's class scores `[num_labels]` (probabilities by
    the model's activation; logits with `use_activation=False`). `pool`: as for `embed`."""
    options = ClassifyOptions(
        use_activation=use_activation, truncate_prompt_tokens=truncate_prompt_tokens
    )
    return _map(ds, "classify", (column,), output_column, engine_args, options, pool)


def score(
    ds: ray.data.Dataset,
    query_column: str = "query",
    document_column: str = "document",
    *,
    output_column: str = "score",
    engine_args: EngineArgs | None = None,
    use_activation: bool | None = None,
    truncate_prompt_tokens: int | None = None,
    **pool: Any,
) -> ray.data.Dataset:
    """`ds` with `output_column`: the relevance of each row's document to its query, as
    `Engine.score` gives it (a cross-encoder, an LLM reranker, MaxSim or cosine, by the
    model). `pool`: as for `embed`."""
    options = ScoreOptions(
        use_activation=use_activation, truncate_prompt_tokens=truncate_prompt_tokens
    )
    columns = (query_column, document_column)
    return _map(ds, "score", columns, output_column, engine_args, options, pool)


def _map(
    ds: ray.data.Dataset,
    task: str,
    columns: tuple[str, ...],
    output_column: str,
    engine_args: EngineArgs | None,
    options: Options,
    pool: dict[str, Any],
) -> ray.data.Dataset:
    names = ds.schema().names if ds.schema() is not None else None
    for column in columns:
        if names is not None and column not in names:
            raise ValueError(f"the dataset has no column {column!r}; its columns: {names}")
    if pool.pop("preserve_order", True):
        # Ray Data may emit blocks out of order unless its context asks otherwise.
        ds.context.execution_options.preserve_order = True
    if "compute" not in pool:
        size = pool.pop("concurrency", 1)
        pool["compute"] = (
            ray.data.ActorPoolStrategy(min_size=size[0], max_size=size[-1])
            if isinstance(size, tuple)
            else ray.data.ActorPoolStrategy(size=size)
        )
    pool.setdefault("batch_size", DEFAULT_BATCH_SIZE)
    return ds.map_batches(
        EngineActor,
        fn_constructor_args=(engine_args or EngineArgs(), task, columns, output_column, options),
        batch_format="numpy",
        **pool,
    )


def _as_input(value: Any, column: str, row: int) -> Any:
    """One cell as an engine input: text, token ids, prompt embeds, or a pair dict."""
    if isinstance(value, str | Mapping):
        return value if isinstance(value, Mapping) else str(value)
    array = np.asarray(value)
    if array.dtype == object:  # a ragged cell: a list of rows
        array = np.array([np.asarray(item) for item in array])
    if array.ndim == 1 and np.issubdtype(array.dtype, np.integer):
        return {"prompt_token_ids": array.tolist()}
    if array.ndim == 2 and np.issubdtype(array.dtype, np.floating):
        return {"prompt_embeds": array}
    raise InputError(
        f"column {column!r} row {row} (of the batch): expected text, token ids or a "
        f"[num_tokens, hidden_size] prompt-embeds array, got {array.dtype} of shape {array.shape}"
    )
