"""A batch's arrays reach the device in one copy (`upload`): each comes back whole, in order,
as int64, whatever its own integer type."""

from __future__ import annotations

import numpy as np
import torch

from vecpool.runner.batch import upload


def test_upload_returns_each_array_as_a_view_of_one_buffer() -> None:
    arrays = [
        np.array([5, 6, 7], dtype=np.int64),
        np.array([], dtype=np.int64),
        np.array([1, 2], dtype=np.int32),
        np.arange(4, dtype=np.int64),
    ]
    out = upload(arrays, torch.device("cpu"))
    assert len(out) == 4
    for got, expected in zip(out, arrays, strict=True):
        assert got.dtype == torch.int64
        assert got.tolist() == expected.tolist()
    assert all(t.untyped_storage().data_ptr() == out[0].untyped_storage().data_ptr() for t in out)
