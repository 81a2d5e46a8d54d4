"""The padded fallback's single copy of a fused q/k/v projection: when q, k and v are
consecutive column blocks of one `[num_tokens, width]` output (as a fused projection's parts
split into heads are), the fallback moves those rows into the padded layout at once. It must
give exactly what three separate copies give (the same attention kernel on the same values,
read through other strides), and per sequence what dense attention gives (1e-6 absolute, values
~1, float32 against a float64 reference)."""

from __future__ import annotations

import pytest
import torch

from tests.models.test_attention import dense_reference
from vecpool.models.layers.attention import AttentionMetadata, _joint_rows, flat_attention

DIM = 8


def metadata(lengths: list[int]) -> AttentionMetadata:
    seq_lens = torch.tensor(lengths)
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu[1:] = seq_lens.cumsum(0)
    seq_ids = torch.repeat_interleave(torch.arange(len(lengths)), seq_lens)
    return AttentionMetadata(
        cu_seqlens=cu,
        max_seqlen=max(lengths),
        seq_ids=seq_ids,
        pos_in_seq=torch.arange(int(seq_lens.sum())) - cu[:-1].long()[seq_ids],
        use_varlen=False,
    )


@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (4, 2)])
@pytest.mark.parametrize("causal", [False, True])
def test_one_copy_of_fused_qkv_rows_attends_as_three_copies_do(
    heads: int, kv_heads: int, causal: bool
) -> None:
    lengths = [5, 1, 12, 7]
    gen = torch.Generator().manual_seed(heads + kv_heads + causal)
    rows = torch.randn(sum(lengths), (heads + 2 * kv_heads) * DIM, generator=gen)
    parts = rows.split([heads * DIM, kv_heads * DIM, kv_heads * DIM], dim=-1)
    q, k, v = (p.view(p.shape[0], -1, DIM) for p in parts)
    joint = _joint_rows(q, k, v)
    assert joint is not None and torch.equal(joint, rows)
    apart = [t.contiguous() for t in (q, k, v)]
    assert _joint_rows(*apart) is None  # three tensors: three copies
    assert _joint_rows(q, v, k) is None  # out of order
    out = flat_attention(q, k, v, metadata(lengths), causal=causal, scale=0.3)
    expected = flat_attention(*apart, metadata(lengths), causal=causal, scale=0.3)
    assert torch.equal(out, expected)
    # A second layer of the same step reuses the zeroed buffer: the same again.
    meta = metadata(lengths)
    flat_attention(q, k, v, meta, causal=causal, scale=0.3)
    assert torch.equal(flat_attention(q, k, v, meta, causal=causal, scale=0.3), expected)
    start = 0
    for n in lengths:
        ref = dense_reference(
            *(t[start : start + n] for t in (q, k, v)),
            causal=causal,
            window=None,
            softcap=None,
            scale=0.3,
        )
        assert (out[start : start + n].double() - ref).abs().max() < 1e-6
        start += n
