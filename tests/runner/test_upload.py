"""A batch's arrays reach the device in one copy (`upload`): each comes back whole, in order,
as int64, whatever its own integer type; the batch's int32 boundaries ride in it too."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vecpool.inputs.prompts import Prompt
from vecpool.runner.batch import build_flat_batch, upload
from vecpool.runner.step import ScheduledChunk, StepInput
from vecpool.tasks import TASKS, PoolingParams


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


@pytest.mark.parametrize("num_seqs", [1, 2, 3, 4])
def test_a_batch_carries_int32_boundaries_and_last_rows_without_kernels(num_seqs: int) -> None:
    """The attention's int32 boundaries are the int64 upload's bytes reread, and each
    sequence's last row comes with the batch: both equal what the int64 boundaries give, for
    odd and even counts of boundaries (the int32 words are padded to whole int64 words); the
    boundaries sit at a 16-byte aligned address."""
    rng = np.random.default_rng(num_seqs)
    chunks = []
    for i in range(num_seqs):
        ids = rng.integers(5, 90, size=int(rng.integers(1, 9)))
        prompt = Prompt(token_ids=ids, prompt_embeds=None)
        params = PoolingParams(task="embed")
        chunks.append(ScheduledChunk(str(i), prompt, params, TASKS["embed"], 0, prompt.num_tokens))
    batch = build_flat_batch(
        StepInput(chunks), torch.device("cpu"), use_varlen=False, with_token_types=False
    )
    cu = batch.pooling.cu_seqlens
    assert batch.attn.cu_seqlens.dtype == torch.int32
    assert batch.attn.cu_seqlens.tolist() == cu.tolist()
    assert cu.tolist() == [0, *np.cumsum([c.num_tokens for c in chunks]).tolist()]
    assert batch.pooling.last_rows.tolist() == (cu[1:] - 1).tolist()
    # 16-byte aligned, as a CUDA graph's own boundaries are: Triton compiles its kernels anew
    # for a pointer that is not (the upload buffer's start is; the allocator aligns it).
    assert batch.attn.cu_seqlens.data_ptr() % 16 == 0
