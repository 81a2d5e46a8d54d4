"""The task heads on the CPU compute a row's output from that row alone, wherever it sits in
a step, so that an input given as prompt embeds and the same input given as ids, in one call,
are answered alike to the bit.

The heads used to run `F.linear`, that is MKL's GEMM, which on Intel AVX-512 CPUs computes a
product with one to three output columns (a reranker's score, a classifier's labels, BGE-M3's
token weight) with kernels that treat neighbouring rows differently, and a product of fewer
than 16 rows with other kernels than a larger one; torch's activations compute the elements
left at the end of a thread's range by scalar code that rounds otherwise. So on the CPU the
heads run their products through oneDNN, whose kernels compute each row alone (as the layer
stack's packed linears do), and their activations piece by piece (`RowwiseHead`); a head
whose rows a request's parameters select weighs the same rows whatever they are (BGE-M3's
lexical weights).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import transformers
from torch import nn

import vecpool
from tests.conftest import tiny_bert_config
from tests.helpers import assert_rel_close, random_prompts, save_hf_model
from vecpool.pooling.heads import (
    ClassifierHead,
    HeadBatch,
    LexicalSparseHead,
    TaskHead,
    TokenClassifierHead,
)
from vecpool.pooling.methods import PoolingMetadata
from vecpool.runner.cpu_linear import RowwiseFunctions, RowwiseHead, onednn_linear
from vecpool.tasks import PoolingParams

CPU = torch.device("cpu")


def _moved_rows_differ(fn: Any, x: torch.Tensor, shifts: list[int]) -> list[int]:
    """The shifts `s` for which `fn` of the rows rolled by `s` is not `fn(x)` rolled by `s`."""
    out = fn(x)
    return [s for s in shifts if not torch.equal(fn(torch.roll(x, s, 0)), torch.roll(out, s, 0))]


@pytest.mark.parametrize("out_features", [1, 2, 3, 32, 99])
@pytest.mark.parametrize("in_features", [32, 48, 384])
def test_onednn_linear_computes_a_row_the_same_at_any_position(
    in_features: int, out_features: int
) -> None:
    gen = torch.Generator().manual_seed(in_features * 1000 + out_features)
    weight = torch.randn(out_features, in_features, generator=gen)
    bias = torch.randn(out_features, generator=gen)
    for rows in [2, 3, 5, 7, 13, 29, 64, 65]:
        x = torch.randn(rows, in_features, generator=gen)
        moved = _moved_rows_differ(lambda t: onednn_linear(t, weight, bias), x, [1, 2, rows - 1])
        assert moved == [], f"{rows} rows: rows computed otherwise after rolling by {moved}"
        # The same product as F.linear, summed in another order (float32: ~1e-6 relative).
        assert_rel_close(onednn_linear(x, weight, bias).numpy(), F.linear(x, weight, bias).numpy())
    # Leading dimensions are kept, as F.linear keeps them; an empty input is an empty output.
    x = torch.randn(2, 3, in_features, generator=gen)
    assert torch.equal(onednn_linear(x, weight, bias)[1], onednn_linear(x[1], weight, bias))
    assert onednn_linear(x[:0], weight).shape == (0, 3, out_features)


def test_onednn_linear_leaves_what_onednn_does_not_serve_to_f_linear() -> None:
    x, weight = torch.randn(4, 8, dtype=torch.float64), torch.randn(3, 8, dtype=torch.float64)
    assert torch.equal(onednn_linear(x, weight), F.linear(x, weight))
    with pytest.raises(RuntimeError):  # mixed dtypes: F.linear's own error, not oneDNN's
        onednn_linear(x.float(), weight)


def test_rowwise_functions_route_linear_and_activations() -> None:
    gen = torch.Generator().manual_seed(0)
    linear = nn.Linear(48, 3)
    x = torch.randn(70, 48, generator=gen)
    with RowwiseFunctions():
        through_module = linear(x)
        # 70 x 48 values: the last 16 are left over after torch's 32-wide vector steps.
        act = F.gelu(x)
    assert torch.equal(through_module, onednn_linear(x, linear.weight, linear.bias))
    assert_rel_close(act.numpy(), F.gelu(x).numpy(), rtol=1e-6)
    moved = _moved_rows_differ(lambda t: _in_rowwise(F.gelu, t), x, [1, 5, 69])
    assert moved == []


def _in_rowwise(fn: Any, *args: Any) -> Any:
    with RowwiseFunctions():
        return fn(*args)


def _one_row_each(hidden: torch.Tensor) -> PoolingMetadata:
    """Metadata of a step whose sequences are one row each."""
    n = hidden.shape[0]
    rows = torch.arange(n)
    return PoolingMetadata(
        cu_seqlens=torch.arange(n + 1),
        lengths=torch.ones(n, dtype=torch.int64),
        seq_ids=rows,
        input_ids=torch.zeros(n, dtype=torch.int64),
        last_rows=rows,
    )


def _classifier_layers(hidden: int, labels: int) -> nn.Module:
    """A ModernBERT-style classifier: dense, gelu, norm, then the labels."""
    torch.manual_seed(labels)
    layers = nn.Sequential(
        nn.Linear(hidden, hidden), nn.GELU(), nn.LayerNorm(hidden), nn.Linear(hidden, labels)
    )
    return layers.eval().requires_grad_(False)


def _heads(hidden: int) -> dict[str, tuple[TaskHead, PoolingParams]]:
    score = _classifier_layers(hidden, 1)
    labels = _classifier_layers(hidden, 3)
    return {
        "score_sigmoid": (ClassifierHead(score, "CLS", "sigmoid"), PoolingParams(task="classify")),
        "labels_softmax": (
            ClassifierHead(labels, "CLS", "softmax"),
            PoolingParams(task="classify"),
        ),
        "tokens": (
            TokenClassifierHead(labels, "sigmoid"),
            PoolingParams(task="token_classify"),
        ),
    }


@pytest.mark.parametrize("kind", ["score_sigmoid", "labels_softmax", "tokens"])
def test_a_rowwise_head_answers_a_row_the_same_at_any_position(kind: str) -> None:
    hidden = 48  # not a multiple of the vector width: activations leave elements over
    head, params = _heads(hidden)[kind]
    wrapped = RowwiseHead(head)
    assert (wrapped.per_token, wrapped.needs_token_ids) == (head.per_token, head.needs_token_ids)
    gen = torch.Generator().manual_seed(1)
    for n in [2, 7, 45, 700]:  # 700 x 48 values: torch splits elementwise work among threads
        x = torch.randn(n, hidden, generator=gen)
        perm = torch.randperm(n, generator=gen)
        plain, moved = _answer(wrapped, x, params), _answer(wrapped, x[perm], params)
        assert np.array_equal(moved, plain[perm.numpy()]), f"{n} rows"
        # The unwrapped head: the same arithmetic, its sums in MKL's order (float32, ~1e-6).
        assert_rel_close(plain, _answer(head, x, params))


def _answer(head: Any, x: torch.Tensor, params: PoolingParams) -> np.ndarray:
    """`[n, width]`: the head's output for rows `x`, one sequence of one row each."""
    n = x.shape[0]
    out = head(HeadBatch(x, _one_row_each(x), torch.arange(n), [params] * n, every=True))
    return np.stack([np.asarray(o).reshape(-1) for o in out])


def test_lexical_weights_are_read_from_the_same_rows_whatever_is_left_out() -> None:
    """What a request leaves out (`exclude_special_tokens`) is dropped after the product, so
    the weights it keeps come from the same product: here a token weight whose result moves
    with the number of rows it is given, as a kernel chosen by shape does, gives the kept
    weights to the bit."""
    vocab, hidden = 12, 8
    gen = torch.Generator().manual_seed(2)
    unused = torch.zeros(vocab, dtype=torch.bool)
    unused[[0, 2]] = True  # cls and eos: never weighed
    special = unused.clone()
    special[[11]] = True  # the mask token: left out on request
    seen: list[int] = []

    def token_weight(rows: torch.Tensor) -> torch.Tensor:  # [n, hidden] -> [n, 1]
        seen.append(rows.shape[0])
        return rows.sum(1, keepdim=True) * (1 + 1e-3 * rows.shape[0])

    head = LexicalSparseHead(token_weight, unused, special)
    ids = torch.tensor([0, 5, 11, 7, 5, 2, 0, 11, 3, 2])  # two prompts of five tokens
    hidden_rows = torch.randn(len(ids), hidden, generator=gen).abs()
    meta = PoolingMetadata(
        cu_seqlens=torch.tensor([0, 5, 10]),
        lengths=torch.tensor([5, 5]),
        seq_ids=torch.tensor([0] * 5 + [1] * 5),
        input_ids=ids,
        last_rows=torch.tensor([4, 9]),
    )

    def weights(exclude: list[bool]) -> list[np.ndarray]:
        params = [PoolingParams(task="sparse", exclude_special_tokens=e) for e in exclude]
        out = head(HeadBatch(hidden_rows, meta, torch.arange(2), params, every=True))
        return [np.asarray(o) for o in out]

    kept = weights([False, False])
    for exclude in ([True, False], [False, True], [True, True]):
        got = weights(exclude)
        for seq, (k, g) in enumerate(zip(kept, got, strict=True)):
            expected = k.copy()
            if exclude[seq]:
                expected[11] = 0.0
            assert np.array_equal(g, expected), (exclude, seq)
    assert set(seen) == {10}  # every row of the two prompts each time
    assert all(k[[0, 2]].max() == 0.0 and k[11] > 0 for k in kept)


# ---- the engine: ids and prompt embeds of one prompt in one call -------------------------


@pytest.fixture(scope="module", params=[1, 3])
def classifier(request: Any, tmp_path_factory: pytest.TempPathFactory) -> vecpool.Engine:
    """A tiny BERT sequence classifier with one label (sigmoid) or three (softmax), asked to
    serve token_embed too (its hidden states, which a classifier is not made to give)."""
    torch.manual_seed(request.param)
    cfg = tiny_bert_config(num_labels=request.param)
    hf = transformers.BertForSequenceClassification(cfg).eval()
    folder = save_hf_model(hf, tmp_path_factory.mktemp(f"bert_labels_{request.param}"))
    return vecpool.Engine(folder, device="cpu", tasks=("token_embed",))


def test_ids_and_embeds_of_one_prompt_in_one_call_classify_alike(
    classifier: vecpool.Engine,
) -> None:
    engine = classifier
    every = random_prompts(99, [3 + (7 * i) % 29 for i in range(24)], seed=3)
    for n in [1, 2, 3, 5, 24]:  # small steps: MKL's kernels for few rows treated rows apart
        prompts = every[:n]
        embeds = [{"prompt_embeds": engine.embed_tokens(p)} for p in prompts]
        # The ids first, then the embeds in reverse: every prompt's two forms apart.
        inputs: list[Any] = [*prompts, *embeds[::-1]]
        for use_activation in (True, False):
            scores = engine.classify(inputs, use_activation=use_activation)
            assert np.array_equal(scores[:n], scores[n:][::-1]), (n, use_activation)
        tokens = engine.encode(inputs, task="token_embed", normalize=False)
        for a, b in zip(tokens[:n], tokens[n:][::-1], strict=True):
            assert np.array_equal(a, b)


def test_the_cpu_engine_runs_its_heads_rowwise(tiny_bert: tuple[Path, Any]) -> None:
    engine = vecpool.Engine(tiny_bert[0], device="cpu")
    heads = engine.core.pooling_runner.heads
    assert heads and all(isinstance(h, RowwiseHead) for h in heads.values())
