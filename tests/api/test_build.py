"""`Engine(...)`'s keywords are `EngineArgs`' fields, and each task method's keywords its options'
fields: one list of options, one default each."""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any

import pytest

from vecpool.api import Engine, EngineArgs
from vecpool.calls import (
    ClassifyOptions,
    EmbedOptions,
    EncodeOptions,
    RerankOptions,
    ScoreOptions,
    SparseOptions,
)


def test_engine_keywords_are_engine_args_fields() -> None:
    params = list(inspect.signature(Engine.__init__).parameters.values())[1:]  # past self
    fields = dataclasses.fields(EngineArgs)
    assert [p.name for p in params] == [f.name for f in fields]
    assert [p.default for p in params] == [f.default for f in fields]


@pytest.mark.parametrize(
    ("method", "options"),
    [
        (Engine.embed, EmbedOptions),
        (Engine.encode, EncodeOptions),
        (Engine.prepare_encode, EncodeOptions),
        (Engine.classify, ClassifyOptions),
        (Engine.prepare_classify, ClassifyOptions),
        (Engine.score, ScoreOptions),
        (Engine.prepare_score, ScoreOptions),
        (Engine.rerank, RerankOptions),
        (Engine.prepare_rerank, RerankOptions),
        (Engine.embed_sparse, SparseOptions),
        (Engine.prepare_embed_sparse, SparseOptions),
    ],
)
def test_task_keywords_are_their_options(method: Any, options: type) -> None:
    """Each task method's keywords are fields of its options, with the same defaults: the
    method builds its options from them (`Options.of(locals())`), so a keyword that is no
    field would be dropped silently, and a second default could drift."""
    defaults = {f.name: f.default for f in dataclasses.fields(options)}
    inputs = {"inputs", "a", "b", "query", "documents", "self", "show_progress"}
    for p in inspect.signature(method).parameters.values():
        if p.name in inputs:
            continue
        assert p.name in defaults, f"{method.__name__}: {p.name} is not a {options.__name__} field"
        assert p.default == defaults[p.name], f"{method.__name__}: {p.name}'s default"


class _Stop(Exception):
    pass


@pytest.mark.parametrize(("device", "index"), [("cuda", None), ("cuda:1", 1)])
def test_memory_fraction_names_the_device_as_torch_takes_it(
    monkeypatch: pytest.MonkeyPatch, device: str, index: int | None
) -> None:
    """`gpu_memory_fraction` on "cuda" (no index: the current device) and "cuda:N": torch's
    `set_per_process_memory_fraction` takes None or an index, and refuses a device without one
    (which `vecpool serve` with two models on "cuda" once hit). Building stops at the call."""
    import torch

    from vecpool.api import build

    calls: list[tuple[float, Any]] = []

    def fraction(value: float, device: Any = None) -> None:
        calls.append((value, device))
        raise _Stop

    monkeypatch.setattr(build, "resolve_device", lambda _: torch.device(device))
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", fraction)
    with pytest.raises(_Stop):
        Engine(gpu_memory_fraction=0.4)
    assert calls == [(0.4, index)]


@pytest.mark.parametrize("limit", [{"max_input_chars": 5}, {"max_model_len": 4}])
def test_limits_below_the_probe_sentence_bind_inputs_not_the_engine(limit: dict) -> None:
    """The engine's probe (a sentence of 42 characters, 10 tokens) is cut to the model's
    limit and is not held to --max-input-chars: an engine started with lower limits runs
    (it refused its own probe, naming "input 0"), and the limits bind the caller's inputs."""
    import numpy as np

    import vecpool

    engine = Engine(device="cpu", **limit)
    assert engine.core._probe_error() is None
    assert engine.embed(["abc"], truncate_prompt_tokens=-1).shape == (1, 384)
    with pytest.raises(vecpool.InputError, match=r"^input 0: the "):
        engine.embed(["a sentence longer than both limits"])
    assert np.isfinite(engine.embed(["ab"], truncate_prompt_tokens=-1)).all()
