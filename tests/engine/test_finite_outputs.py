"""Which pooled outputs are finite (`_finite_outputs`, which fails the others' requests): one
check over the step's outputs when they share a shape, one each otherwise, and both give what
checking each output alone gives."""

from __future__ import annotations

import numpy as np
import pytest

from vecpool.engine.core import _finite_outputs
from vecpool.runner.pooling_runner import PooledResult


def _alone(outputs: list[np.ndarray | None]) -> list[bool]:
    return [o is not None and bool(np.isfinite(o).all()) for o in outputs]


@pytest.mark.parametrize(
    "shape",
    [(4,), (3, 2), (1,), (0,), (2, 0), ()],
    ids=["vector", "rows", "score", "empty", "empty-rows", "scalar"],
)
def test_outputs_of_one_shape_are_checked_as_each_alone(shape: tuple[int, ...]) -> None:
    rng = np.random.default_rng(0)
    host = rng.standard_normal((5, *shape)).astype(np.float32)
    size = int(np.prod(shape))
    if size:  # a bad value in some outputs only, first or last
        flat = host.reshape(5, size)
        flat[1, -1], flat[3, -1], flat[4, 0] = np.nan, np.inf, -np.inf
    outputs: list[np.ndarray | None] = list(host)  # row views of one array, as heads give
    got = _finite_outputs([PooledResult(o, None) for o in outputs])
    assert got == _alone(outputs)
    assert got == ([True, False, True, False, False] if size else [True] * 5)


def test_mixed_shapes_and_missing_outputs() -> None:
    outputs: list[np.ndarray | None] = [
        np.ones(3, np.float32),
        None,
        np.array([1.0, np.nan], np.float32),
        np.ones((2, 3), np.float32),
    ]
    assert _finite_outputs([PooledResult(o, None) for o in outputs]) == [True, False, False, True]
