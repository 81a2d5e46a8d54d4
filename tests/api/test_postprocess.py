"""The pure post-processing functions of `vecpool.api.postprocess`."""

from __future__ import annotations

import numpy as np
import pytest

import vecpool.scoring
from vecpool.api import calls, postprocess


def test_postprocess_functions() -> None:
    assert postprocess.rank(np.array([0.1, 0.5, 0.5, -1.0]), top_n=3) == [
        (1, 0.5),
        (2, 0.5),
        (0, 0.1),
    ]
    weights = np.array([0.0, 0.3, 0.0, 1.2, 0.05, 0.3], dtype=np.float32)
    assert list(postprocess.sparse_vector(weights)) == [3, 1, 5, 4]
    assert postprocess.sparse_vector(weights, top_k=2) == {
        3: pytest.approx(1.2),
        1: pytest.approx(0.3),
    }
    assert list(postprocess.sparse_vector(weights, threshold=0.1)) == [3, 1, 5]
    assert postprocess.sparse_vector(weights, top_k=0) == {}
    q = np.array([[1.0, 0.0], [0.0, 1.0]])
    d = [np.array([[0.5, 0.5], [1.0, 0.0]]), np.array([[0.0, 2.0]])]
    assert postprocess.maxsim(q, d).tolist() == [1.5, 2.0]
    assert postprocess.rank(np.array([0.1, 0.5]), top_n=0) == [(1, 0.5), (0, 0.1)]
    assert postprocess.maxsim(q, d, mean=True).tolist() == [0.75, 1.0]
    assert postprocess.cosine(np.array([[3.0, 4.0]]), np.array([[6.0, 8.0]])).tolist() == [1.0]


def test_the_former_module_re_exports_them() -> None:
    assert vecpool.scoring.rank is postprocess.rank
    assert vecpool.scoring.pair_up is calls.pair_up
