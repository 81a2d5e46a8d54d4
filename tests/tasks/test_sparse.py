"""SPLADE sparse vectors from the masked-LM head, against a direct computation from
transformers' `BertForMaskedLM` logits."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import vecpool
from tests.helpers import assert_rel_close

TEXTS = ["cats eat fish and meat", "the stock market fell", "a b c d e f g h i j k l m n o p"]


def _reference(hf: Any, ids: list[int], special: set[int]) -> np.ndarray:
    """max over non-special positions of log(1 + relu(logits)): `[vocab]`."""
    with torch.no_grad():
        logits = hf(input_ids=torch.tensor([ids])).logits[0]
    keep = torch.tensor([i not in special for i in ids])
    weights = torch.log(1 + torch.relu(logits[keep]))
    return weights.max(dim=0).values.numpy()


def test_splade_matches_masked_lm_logits(
    splade: tuple[Path, Any], splade_engine: vecpool.Engine
) -> None:
    engine = splade_engine
    special = {engine.tokenizer.token_to_id(t) for t in ("[CLS]", "[SEP]", "[PAD]", "[MASK]")}
    dense = engine.encode(TEXTS, task="sparse")  # [vocab] per input, one batch
    vectors = engine.embed_sparse(TEXTS)
    for text, row, vector in zip(TEXTS, dense, vectors, strict=True):
        ids = engine.tokenize(text)
        assert ids[0] in special and ids[-1] in special
        expected = _reference(splade[1], ids, special)
        assert row.shape == (engine.model.vocab_size,)
        assert_rel_close(row, expected)
        nonzero = np.flatnonzero(row > 0)
        assert sorted(vector) == nonzero.tolist()
        assert list(vector.values()) == sorted(vector.values(), reverse=True)
        assert all(vector[i] == pytest.approx(float(row[i])) for i in nonzero)


def test_splade_pruning_and_tokens(splade_engine: vecpool.Engine) -> None:
    engine = splade_engine
    (full,) = engine.embed_sparse(TEXTS[:1])
    (top,) = engine.embed_sparse(TEXTS[:1], top_k=5)
    assert list(top.items()) == list(full.items())[:5]
    cut = sorted(full.values())[len(full) // 2]
    (above,) = engine.embed_sparse(TEXTS[:1], threshold=cut)
    assert above == {k: v for k, v in full.items() if v > cut}
    (named,) = engine.embed_sparse(TEXTS[:1], top_k=5, return_tokens=True)
    assert list(named) == [engine.tokenizer.id_to_token(i) for i in top]
    assert list(named.values()) == list(top.values())


def test_splade_needs_token_ids(splade_engine: vecpool.Engine) -> None:
    """Prompt embeds fail alone (special tokens are found by id); the others are served."""
    engine = splade_engine
    ids = engine.tokenize(TEXTS[1])
    results = engine.pool(
        [TEXTS[0], {"prompt_embeds": engine.embed_tokens(ids)}, ids],
        vecpool.PoolingParams(task="sparse"),
    )
    assert isinstance(results[1].error, vecpool.RequestFailedError)
    assert "input 1 (prompt_embeds): task 'sparse' needs token ids" in str(results[1].error)
    assert results[0].error is None and results[2].error is None
    with pytest.raises(vecpool.RequestFailedError, match="input 1"):
        engine.embed_sparse([TEXTS[0], {"prompt_embeds": engine.embed_tokens(ids)}])
