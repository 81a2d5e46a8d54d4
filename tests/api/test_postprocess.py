"""The pure post-processing functions of `vecpool.calls.postprocess`."""

from __future__ import annotations

import numpy as np
import pytest

import vecpool
import vecpool.scoring
from vecpool import calls
from vecpool.calls import postprocess


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


@pytest.mark.parametrize("precision", ["float32", "int8", "uint8", "binary", "ubinary"])
def test_quantize_equals_sentence_transformers(precision: str, minilm: vecpool.Engine) -> None:
    from sentence_transformers.util.quantization import quantize_embeddings

    texts = ["A man is eating food.", "A man eats bread.", "The sky is blue.", "cats", "dogs"]
    vectors = minilm.embed(texts)
    calibration = minilm.embed(["a calibration sentence", "another one", "a third one"])
    ranges = np.vstack((vectors.min(axis=0) * 0.5, vectors.max(axis=0) * 0.5))
    for kwargs in ({}, {"ranges": ranges}, {"calibration_embeddings": calibration}):
        if precision != "float32" or not kwargs:
            expected = quantize_embeddings(vectors, precision, **kwargs)
            got = postprocess.quantize(vectors, precision, **kwargs)
            assert got.dtype == expected.dtype and np.array_equal(got, expected), kwargs
    # The engine's own: the same function over the call's vectors.
    expected = quantize_embeddings(vectors, precision)
    assert np.array_equal(minilm.embed(texts, precision=precision), expected)
    if precision in ("int8", "uint8"):
        got = minilm.embed(texts, precision=precision, ranges=ranges)
        assert np.array_equal(got, quantize_embeddings(vectors, precision, ranges=ranges))
        with pytest.raises(vecpool.InputError, match="single embedding") as caught:
            minilm.embed(texts[:1], precision=precision)
        assert caught.value.field == "ranges"
    if precision.endswith("binary"):
        assert expected.shape == (len(texts), 384 // 8)


def test_quantization_arguments_are_checked(minilm: vecpool.Engine) -> None:
    for kwargs, words in (
        ({"precision": "int4"}, "precision must be one of"),
        ({"precision": "int8", "ranges": np.zeros((2, 3))}, "2 rows"),
        ({"precision": "binary", "ranges": np.zeros((2, 384))}, "apply to int8 and uint8"),
    ):
        with pytest.raises(vecpool.InputError, match=words):
            minilm.embed(["a", "b"], **kwargs)
    # A dimension count that is not a multiple of 8 packs with zero bits at the end.
    vectors = np.array([[1.0, -1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.5]])
    assert postprocess.quantize(vectors, "ubinary").tolist() == [[0b10111111, 0b11000000]]
    assert postprocess.quantize(vectors, "binary").tolist() == [
        [0b10111111 - 128, 0b11000000 - 128]
    ]
