"""`flat_attention` with cached keys: chunks whose queries are the last rows of longer key
sequences (queries aligned to the end of the keys), against dense attention over each whole
sequence, on the CPU's padded fallback — causal, with a sliding window, with soft-capping,
with grouped-query heads; and the chunks' own keys and values kept for their next chunks.

Tolerance: 1e-6 absolute (values ~1; float32 attention against a float64 reference).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vecpool.inputs.prompts import Prompt
from vecpool.models.layers.attention import flat_attention
from vecpool.runner.batch import build_flat_batch
from vecpool.runner.kv_cache import KVCache
from vecpool.runner.step import ScheduledChunk, StepInput
from vecpool.tasks import TASKS, PoolingParams

HEADS, KV_HEADS, DIM = 4, 2, 8


def dense_reference(
    q: torch.Tensor,  # [L, H, D]
    k: torch.Tensor,  # [L, KV, D]
    v: torch.Tensor,
    *,
    causal: bool,
    window: int | None,
    softcap: float | None,
    scale: float,
) -> torch.Tensor:  # [L, H, D] float64
    """Attention of one whole sequence with itself, in float64, mask written out."""
    q, k, v = q.double(), k.double(), v.double()
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    i = torch.arange(q.shape[0])[:, None]
    j = torch.arange(k.shape[0])[None, :]
    allowed = torch.ones_like(scores[0], dtype=torch.bool)
    if causal:
        allowed &= j <= i
    if window is not None:
        allowed &= (i - j).abs() < window
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hqk,khd->qhd", torch.softmax(scores, dim=-1), v)


@pytest.mark.parametrize(
    ("window", "softcap"), [(None, None), (3, None), (None, 2.0), (5, 1.5)], ids=str
)
def test_chunks_attend_to_their_cached_keys(window: int | None, softcap: float | None) -> None:
    gen = torch.Generator().manual_seed(0)
    # Per sequence: its whole length, and the chunk this step runs (start, length). The first
    # runs whole; the others are later (or first, unfinished) chunks of longer prompts.
    spans = [(6, 0, 6), (15, 5, 4), (12, 9, 3), (20, 0, 7), (9, 1, 8)]
    cache = KVCache()
    full = []
    for i, (n, start, _) in enumerate(spans):
        q = torch.randn(n, HEADS, DIM, generator=gen)
        k = torch.randn(n, KV_HEADS, DIM, generator=gen)
        v = torch.randn(n, KV_HEADS, DIM, generator=gen)
        full.append((q, k, v))
        if start:  # what the earlier chunks left
            keys, values = cache.buffers(f"r{i}", n).layer(0, k)
            keys[:start], values[:start] = k[:start], v[:start]
    chunks = [
        ScheduledChunk(
            f"r{i}",
            Prompt(token_ids=np.zeros(n, dtype=np.int64), prompt_embeds=None),
            PoolingParams(),
            TASKS["embed"],
            start,
            m,
        )
        for i, (n, start, m) in enumerate(spans)
    ]
    batch = build_flat_batch(
        StepInput(chunks),
        torch.device("cpu"),
        use_varlen=False,
        with_token_types=False,
        kv_cache=cache,
    )
    assert batch.attn.kv is not None
    assert cache.num_entries == 4  # every sequence but the whole one
    rows = [
        (q[s : s + m], k[s : s + m], v[s : s + m])
        for (q, k, v), (_, s, m) in zip(full, spans, strict=True)
    ]
    q, k, v = (torch.cat([r[j] for r in rows]) for j in range(3))
    out = flat_attention(
        q, k, v, batch.attn, causal=True, scale=DIM**-0.5, window=window, softcap=softcap
    )
    at = 0
    for (fq, fk, fv), (_, start, m) in zip(full, spans, strict=True):
        want = dense_reference(
            fq, fk, fv, causal=True, window=window, softcap=softcap, scale=DIM**-0.5
        )[start : start + m]
        assert (out[at : at + m].double() - want).abs().max() <= 1e-6
        at += m
    # A chunk that does not end its prompt kept its keys and values at its positions.
    for i, ((_, fk, fv), (n, start, m)) in enumerate(zip(full, spans, strict=True)):
        if start + m < n:
            keys, values = cache.buffers(f"r{i}", n).layer(0, fk)
            assert torch.equal(keys[: start + m], fk[: start + m])
            assert torch.equal(values[: start + m], fv[: start + m])
    assert cache.num_bytes == sum(
        2 * n * KV_HEADS * DIM * 4 for n, s, m in spans if (s, m) != (0, n)
    )
    cache.release([f"r{i}" for i in range(len(spans))])
    assert (cache.num_entries, cache.num_bytes) == (0, 0)


def test_a_bias_shared_by_layers_builds_its_mask_once() -> None:
    """Layers passing the step's one bias (MPNet, T5, ALiBi) share its additive mask, built at
    the first; another bias (DeBERTa's, per layer) builds its own. Each output equals the dense
    reference with its bias (tolerance: float32 against float64, as above)."""
    from vecpool.models.layers.attention import AttentionMetadata

    gen = torch.Generator().manual_seed(3)
    lengths, scale = [5, 3], 0.5
    cu = torch.tensor([0, 5, 8], dtype=torch.int32)
    seq_ids = torch.repeat_interleave(torch.arange(2), torch.tensor(lengths))
    pos = torch.cat([torch.arange(n) for n in lengths])
    meta = AttentionMetadata(cu, 5, seq_ids, pos, use_varlen=False)
    q, k, v = (torch.randn(8, HEADS, DIM, generator=gen) for _ in range(3))

    def reference(bias: torch.Tensor) -> torch.Tensor:
        outs = []
        for a, b in ((0, 5), (5, 8)):
            n = b - a
            scores = torch.einsum("qhd,khd->hqk", q[a:b].double(), k[a:b].double()) * scale
            scores = scores + bias[0, :, :n, :n].double()
            probs = torch.softmax(scores, dim=-1)
            outs.append(torch.einsum("hqk,khd->qhd", probs, v[a:b].double()))
        return torch.cat(outs)

    bias = torch.randn(1, HEADS, 5, 5, generator=gen)
    other = torch.randn(1, HEADS, 5, 5, generator=gen)
    first = flat_attention(q, k, v, meta, causal=False, scale=scale, bias=bias)
    assert meta._biased is not None
    built = meta._biased[2]
    again = flat_attention(q, k, v, meta, causal=False, scale=scale, bias=bias)
    assert meta._biased[2] is built  # the second layer reused the first's mask
    third = flat_attention(q, k, v, meta, causal=False, scale=scale, bias=other)
    assert meta._biased[0] is other and meta._biased[2] is not built
    for out, b in ((first, bias), (again, bias), (third, other)):
        np.testing.assert_allclose(out.double().numpy(), reference(b).numpy(), rtol=0, atol=1e-6)
