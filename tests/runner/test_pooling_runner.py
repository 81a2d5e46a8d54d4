"""The pooling runner across the chunks of a prompt, apart from attention: the same hidden
rows pooled in one step, or in chunks over several steps (next to other requests), give the
same outputs for every head and sequence method; the state kept between steps is released at
the last chunk, and a step that fails leaves it as it was.

Tolerance: 1e-6 of the largest magnitude (at least 1): sums over chunks add the same float32
terms in another order (about 2 ulps here); rows, maxima and per-token outputs are bit-exact.
"""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np
import pytest
import torch

from vecpool.config import SEQUENCE_METHODS
from vecpool.inputs.prompts import Prompt
from vecpool.models.loading.st import DenseStack
from vecpool.pooling.heads import (
    ClassifierHead,
    EmbedHead,
    SparseHead,
    TaskHead,
    TokenClassifierHead,
    TokenEmbedHead,
    normalize_rows,
    truncate_and_normalize,
)
from vecpool.runner.batch import build_flat_batch
from vecpool.runner.kv_cache import KVCache
from vecpool.runner.pooling_runner import PoolingRunner
from vecpool.runner.step import ScheduledChunk, StepInput
from vecpool.tasks import TASKS, Head, PoolingParams

HIDDEN, VOCAB, N = 6, 11, 23
CPU = torch.device("cpu")
GEN = torch.Generator().manual_seed(0)
PROJECT = torch.randn(HIDDEN, VOCAB, generator=GEN)
LABELS = torch.randn(HIDDEN, 3, generator=GEN)
SPECIAL = torch.zeros(VOCAB, dtype=torch.bool)
SPECIAL[[0, 1]] = True


def _head(kind: str) -> tuple[Head, TaskHead, PoolingParams]:
    """A head of each kind, with the parameters of a request that reaches it."""
    if kind in SEQUENCE_METHODS:
        return Head.EMBEDDING, EmbedHead(kind, DenseStack(), False, HIDDEN), PoolingParams()
    if kind.startswith("sparse"):
        head = SparseHead(lambda rows: rows @ PROJECT, SPECIAL, kind.split("_")[1], slice_tokens=5)
        return Head.SPARSE, head, PoolingParams(task="sparse", exclude_special_tokens=True)
    if kind == "classify_cls":
        head = ClassifierHead(lambda rows: rows @ LABELS, "CLS", "softmax")
        return Head.SEQUENCE_CLASSIFIER, head, PoolingParams(task="classify")
    if kind == "token_embed_step":
        head = TokenEmbedHead(None, True, HIDDEN)
        return Head.TOKEN_EMBEDDING, head, PoolingParams(task="token_embed", step_tag_id=4)
    head = TokenClassifierHead(lambda rows: rows @ LABELS, "softmax")
    return Head.TOKEN_CLASSIFIER, head, PoolingParams(task="token_classify")


KINDS = [*SEQUENCE_METHODS, "sparse_max", "sparse_sum", "classify_cls", "token_embed_step"]
KINDS.append("token_classify")


def _chunk(request_id: str, prompt: Prompt, params: PoolingParams, start: int, n: int) -> Any:
    return ScheduledChunk(request_id, prompt, params, TASKS[params.task], start, n)


def _pool(runner: PoolingRunner, chunks: list[ScheduledChunk], rows: list[torch.Tensor]) -> list:
    step = StepInput(chunks)
    batch = build_flat_batch(
        step, CPU, use_varlen=False, with_token_types=False, kv_cache=KVCache()
    )
    return runner.pool(torch.cat(rows), batch, step)


@pytest.mark.parametrize("kind", KINDS)
def test_chunks_pool_as_the_whole_prompt(kind: str) -> None:
    head_name, head, params = _head(kind)
    ids = torch.randint(0, VOCAB, (N,), generator=GEN).numpy()
    ids[ids == 4] = 5
    ids[[2, 9, 17]] = 4  # STEP tags in the first, second and third chunk
    prompt = Prompt(token_ids=ids, prompt_embeds=None)
    hidden = torch.randn(N, HIDDEN, generator=GEN) * 3
    other = Prompt(token_ids=ids[:5].copy(), prompt_embeds=None)
    other_hidden = torch.randn(5, HIDDEN, generator=GEN)

    whole_runner = PoolingRunner({head_name: head}, CPU)
    (whole,) = _pool(whole_runner, [_chunk("a", prompt, params, 0, N)], [hidden])
    (other_whole,) = _pool(whole_runner, [_chunk("b", other, params, 0, 5)], [other_hidden])

    runner = PoolingRunner({head_name: head}, CPU)
    bounds = [0, 7, 8, 16, N]  # a one-token chunk among them
    for i, (start, end) in enumerate(itertools.pairwise(bounds)):
        chunks, rows = [_chunk("a", prompt, params, start, end - start)], [hidden[start:end]]
        if i == 1:  # another request shares a step, before the chunk
            chunks.insert(0, _chunk("b", other, params, 0, 5))
            rows.insert(0, other_hidden)
        results = _pool(runner, chunks, rows)
        last = results[-1]
        assert last.error is None and last.done == (end == N)
        assert runner.num_states == (0 if end == N else 1)
        if i == 1:
            assert results[0].done and np.array_equal(results[0].output, other_whole.output)
    assert last.output is not None and whole.output is not None
    assert last.output.shape == whole.output.shape
    if kind == "token_embed_step":
        assert last.output.shape[0] == 3
    if kind in ("CLS", "LAST", "MAX", "sparse_max", "classify_cls") or kind.startswith("token"):
        assert np.array_equal(last.output, whole.output)
    scale = max(1.0, float(np.abs(whole.output).max()))
    assert np.abs(last.output - whole.output).max() <= 1e-6 * scale


def test_a_failed_step_leaves_the_carried_state_as_it_was(monkeypatch: pytest.MonkeyPatch) -> None:
    head_name, head, params = _head("MEAN")
    prompt = Prompt(token_ids=np.arange(10) % VOCAB, prompt_embeds=None)
    hidden = torch.randn(10, HIDDEN, generator=GEN)
    runner = PoolingRunner({head_name: head}, CPU)
    (whole,) = _pool(
        PoolingRunner({head_name: head}, CPU), [_chunk("a", prompt, params, 0, 10)], [hidden]
    )
    _pool(runner, [_chunk("a", prompt, params, 0, 4)], [hidden[:4]])
    kept = {k: v.clone() for k, v in runner._states["a"].carried.items()}

    class Broken:
        per_token = False
        needs_token_ids = False

        def __call__(self, b: Any) -> Any:
            b.merge("pooled", torch.zeros(b.num_seqs, HIDDEN), "sum")  # records, then fails
            raise RuntimeError("head fell over")

    monkeypatch.setattr(runner, "heads", {head_name: Broken()})
    with pytest.raises(RuntimeError, match="head fell over"):
        _pool(runner, [_chunk("a", prompt, params, 4, 3)], [hidden[4:7]])
    assert all(torch.equal(runner._states["a"].carried[k], v) for k, v in kept.items())
    monkeypatch.setattr(runner, "heads", {head_name: head})
    _pool(runner, [_chunk("a", prompt, params, 4, 3)], [hidden[4:7]])
    (last,) = _pool(runner, [_chunk("a", prompt, params, 7, 3)], [hidden[7:]])
    assert np.abs(last.output - whole.output).max() <= 1e-6
    runner.release(["a"])
    assert runner.num_states == 0


@pytest.mark.parametrize(
    ("dims", "normalize"),
    [
        ([8, 8, 8], [True, True, True]),  # the short path: one norm, one division
        ([8, 8, 8], [False, False, False]),  # the short path: nothing
        ([8, 8, 8], [True, False, True]),
        ([8, 3, 8], [True, True, True]),
        ([5, 3, 8], [False, False, False]),
    ],
)
def test_normalize_rows_is_the_general_path_to_the_bit(
    dims: list[int], normalize: list[bool]
) -> None:
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(0)) * 10
    x[1, 0] = 0.0  # and a row of tiny norm: the clamp
    x[1] *= 1e-20
    general = truncate_and_normalize(
        x, torch.tensor(dims), torch.tensor(normalize, dtype=torch.bool)
    )
    assert torch.equal(normalize_rows(x, dims, normalize), general)
    if all(normalize):
        assert torch.allclose(general[[0, 2]].norm(dim=1), torch.ones(2))
