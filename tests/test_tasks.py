"""Tasks declare what they need; a request that cannot be served fails alone."""

from __future__ import annotations

import numpy as np
import pytest

import vecpool
from tests.helpers import engine_hidden
from vecpool.tasks import TASKS, PoolingParams

TAG = 42


def test_task_declarations() -> None:
    embed, token_embed = TASKS["embed"], TASKS["token_embed"]
    assert not embed.needs_token_ids(PoolingParams())
    assert not token_embed.needs_token_ids(PoolingParams(task="token_embed"))
    assert token_embed.needs_token_ids(PoolingParams(task="token_embed", step_tag_id=TAG))
    assert token_embed.needs_token_ids(PoolingParams(task="token_embed", step_tag_id=0))


def test_step_selects_tagged_positions(tiny_bert_engine: vecpool.Engine) -> None:
    engine = tiny_bert_engine
    prompts = [[5, TAG, 7, 8, TAG], [9, 10, 11], [TAG, 3]]
    full = engine_hidden(engine, prompts)
    steps = engine.encode(prompts, task="token_embed", step_tag_id=TAG, normalize=False)
    # Bit for bit: the same batch, so the same forward, and without normalization or a
    # projection the head only picks rows of it (no arithmetic on them).
    for prompt, rows, sel in zip(prompts, full, steps, strict=True):
        positions = [i for i, t in enumerate(prompt) if t == TAG]
        assert sel.shape == (len(positions), 32)
        assert np.array_equal(sel, rows[positions])


def test_token_id_task_fails_for_embeds_input_only(tiny_bert_engine: vecpool.Engine) -> None:
    engine = tiny_bert_engine
    prompts = [[5, TAG, 7], [TAG, 8, 9, TAG], [3, 4, TAG]]
    expected = engine.encode(prompts, task="token_embed", step_tag_id=TAG)
    inputs = [prompts[0], {"prompt_embeds": engine.embed_tokens(prompts[1])}, prompts[2]]
    params = PoolingParams(task="token_embed", step_tag_id=TAG)
    steps_before = engine.core.num_steps
    results = engine.pool(inputs, params)
    assert engine.core.num_steps == steps_before + 1  # all three ran in one engine step
    assert results[1].data is None
    assert isinstance(results[1].error, vecpool.RequestFailedError)
    assert results[1].error.index == 1
    assert "needs token ids" in str(results[1].error)
    assert "input 1" in str(results[1].error)
    for i in (0, 2):  # the same forward, but the head normalizes fewer rows: 1e-6 of <= 1
        assert results[i].error is None
        assert np.abs(results[i].data - expected[i]).max() <= 1e-6
    with pytest.raises(
        vecpool.RequestFailedError, match=r"input 1 \(prompt_embeds\): task 'token_embed'"
    ):
        engine.encode(inputs, task="token_embed", step_tag_id=TAG)
    # The same embeds serve a task that does not need ids, and the next call works.
    plain = engine.encode(inputs, task="token_embed")
    assert [p.shape[0] for p in plain] == [3, 4, 3]
    again = engine.encode(prompts, task="token_embed", step_tag_id=TAG)
    for a, b in zip(again, expected, strict=True):  # the same call: the same computation
        assert np.array_equal(a, b)


def test_token_embed_dimensions_and_normalize(tiny_bert_engine: vecpool.Engine) -> None:
    engine = tiny_bert_engine
    (raw,) = engine.encode([[5, 6, 7, 8]], task="token_embed", normalize=False)
    (cut,) = engine.encode([[5, 6, 7, 8]], task="token_embed", dimensions=8)
    expected = raw[:, :8] / np.linalg.norm(raw[:, :8], axis=1, keepdims=True)
    assert cut.shape == (4, 8)
    assert np.abs(cut - expected).max() < 1e-6
