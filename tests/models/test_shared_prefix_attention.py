"""Attention split at a shared cached prefix (`SharedPrefixes`): each group of sequences reads
its prefix once, and the halves merge by their log-sum-exps.

The split runs with the varlen kernel only (CUDA). Here the varlen kernel is replaced by a
per-sequence reference (`reference_varlen`, windows and all), which the model runner then
takes as available on the CPU, so the whole path — grouping, key layouts, merging — runs on
the CPU against the same engine without the cache. Not bit-exact: the halves' softmaxes are
normalized apart and merged, so fp32 sums round differently: compared to 1e-5 of the largest
value (`REORDERED_RTOL`), as the other prefix-caching tests.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import vecpool
from tests.engine.test_prefix_cache import QWEN3, _shared
from tests.helpers import REORDERED_RTOL, assert_rel_close, padded_cpu_attention, save_hf_model
from vecpool.engine.prefix_cache import BLOCK_SIZE as B
from vecpool.models.layers import attention, split_attention
from vecpool.runner.compiled import compile_blocks


def reference_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_q: torch.Tensor,
    cu_k: torch.Tensor,
    max_q: int,
    max_k: int,
    *,
    scale: float,
    window_size: tuple[int, int],
    enable_gqa: bool = False,
) -> torch.Tensor:
    """`varlen_attn` written out per sequence in float32: queries aligned to the end of their
    keys; a key j is seen from key position p when p - left <= j <= p + right (-1: no bound)."""
    left, right = window_size
    group = q.shape[1] // k.shape[1]
    outs = []
    bounds_q, bounds_k = cu_q.tolist(), cu_k.tolist()
    for i in range(len(bounds_q) - 1):
        qs = q[bounds_q[i] : bounds_q[i + 1]].float()
        ks = k[bounds_k[i] : bounds_k[i + 1]].float().repeat_interleave(group, dim=1)
        vs = v[bounds_k[i] : bounds_k[i + 1]].float().repeat_interleave(group, dim=1)
        pos = torch.arange(qs.shape[0])[:, None] + ks.shape[0] - qs.shape[0]
        key = torch.arange(ks.shape[0])[None, :]
        seen = torch.ones(qs.shape[0], ks.shape[0], dtype=torch.bool)
        if left >= 0:
            seen &= key >= pos - left
        if right >= 0:
            seen &= key <= pos + right
        logits = torch.einsum("qhd,khd->hqk", qs, ks) * scale
        probs = torch.softmax(logits.masked_fill(~seen, float("-inf")), dim=-1)
        outs.append(torch.einsum("hqk,khd->qhd", probs, vs))
    return torch.cat(outs).to(q.dtype)


@pytest.fixture
def varlen_on_cpu(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The model runner takes the varlen path on the CPU (with `reference_varlen`); returns
    the number of attention calls split at a shared prefix, counted as they happen."""
    monkeypatch.setattr(attention, "_varlen_kernel", lambda: (reference_varlen, True))
    monkeypatch.setattr("vecpool.runner.model_runner.varlen_available", lambda d, t: True)
    calls = [0]
    split = split_attention.shared_prefix_attention

    def counting(*args: Any, **kwargs: Any) -> torch.Tensor:
        calls[0] += 1
        return split(*args, **kwargs)

    monkeypatch.setattr(split_attention, "shared_prefix_attention", counting)
    return calls


def test_merging_two_halves_gives_attention_over_all_keys() -> None:
    torch.manual_seed(0)
    q = torch.randn(7, 4, 8)
    k, v = torch.randn(30, 2, 8), torch.randn(30, 2, 8)  # grouped-query: 2 key heads
    cu_q, cu_all = torch.tensor([0, 7], dtype=torch.int32), torch.tensor([0, 30])
    whole = reference_varlen(q, k, v, cu_q, cu_all, 7, 30, scale=0.3, window_size=(-1, -1))
    # Keys 0..11 in one half, 12..29 in the other (the second causal: the queries are its end).
    halves = [
        split_attention.attention_with_lse(
            q, k[a:b], v[a:b], cu_q, torch.tensor([0, b - a]), 7, b - a, scale=0.3, causal=False
        )
        for a, b in ((0, 12), (12, 30))
    ]
    merged = split_attention.merge_attention(*halves[0], *halves[1])
    torch.testing.assert_close(merged, whole, rtol=0, atol=1e-6)
    causal = split_attention.attention_with_lse(
        q, k[12:], v[12:], cu_q, torch.tensor([0, 18]), 7, 18, scale=0.3, causal=True
    )
    merged = split_attention.merge_attention(*halves[0], *causal)
    expected = reference_varlen(q, k, v, cu_q, cu_all, 7, 30, scale=0.3, window_size=(-1, 0))
    torch.testing.assert_close(merged, expected, rtol=0, atol=1e-6)


@pytest.mark.parametrize("pooling", ["LAST", "MEAN"])
def test_readers_of_one_prefix_read_it_once(
    varlen_on_cpu: list[int], tmp_path: Path, pooling: str
) -> None:
    """Four prompts of one prefix: the first call's readers join the step that computes it,
    the second call's read it from the pool; both equal the engine without the cache. The
    test model's layers past the first have sliding windows, which keep the copying path:
    both paths run in one forward."""
    folder = save_hf_model(QWEN3.hf_model(), tmp_path)
    prompts = _shared(3 * B + 5, [9, 2, 20, 1])
    expected = vecpool.Engine(folder, device="cpu", pooling=pooling).embed(prompts, normalize=False)
    engine = vecpool.Engine(folder, device="cpu", pooling=pooling, enable_prefix_caching=True)
    assert engine.model_runner.use_varlen
    for call in range(2):
        for got, want in zip(engine.embed(prompts, normalize=False), expected, strict=True):
            assert_rel_close(got, want, rtol=REORDERED_RTOL)
        assert varlen_on_cpu[0] == call + 1  # the one full-attention layer, once per call
    assert engine.core.prefix_cache_stats[0] == 3 * 3 * B + 4 * B + 3 * 3 * B


@pytest.mark.parametrize("graphs", [False, True])
def test_chunks_after_a_shared_prefix(
    varlen_on_cpu: list[int], tmp_path: Path, graphs: bool
) -> None:
    """A token budget of 24: prompts of 70 ids that start after a cached prefix of 2 blocks
    run in chunks, each later chunk attending to its earlier chunks' positions past the
    prefix and to the prefix, read from the pool. With graphs, steps holding chunks of longer
    prompts run without them (their keys are laid out per step), with the same results."""
    folder = save_hf_model(QWEN3.hf_model(), tmp_path)
    prompts = _shared(2 * B + 3, [50, 40, 45])
    options: dict[str, Any] = dict(device="cpu", pooling="MEAN", max_num_batched_tokens=24)
    expected = vecpool.Engine(folder, cuda_graphs=False, **options).embed(prompts, normalize=False)
    engine = vecpool.Engine(folder, enable_prefix_caching=True, cuda_graphs=graphs, **options)
    for prompt, want in zip(prompts, expected, strict=True):
        assert_rel_close(engine.embed([prompt], normalize=False)[0], want, rtol=REORDERED_RTOL)
    assert varlen_on_cpu[0] >= 4  # the 2nd and 3rd prompts: at least two chunks each
    # Chunks of 24 end inside blocks: a prompt registers the whole blocks of its first
    # computed chunk. The first registers block 0; the second reads it and registers block 1
    # (positions 16-31, inside its chunk 16-39); the third reads both.
    assert engine.core.prefix_cache_stats[0] == B + 2 * B


def test_compiled_layers_read_shared_prefixes_without_graph_breaks(
    varlen_on_cpu: list[int], tmp_path: Path
) -> None:
    """Compiled blocks reach the split attention through the `vecpool::cached_attention` op:
    each block stays one graph on steps that read the pool, no recompiles from call to call,
    and the results are bit-exact with the uncompiled engine with the cache (same kernels,
    called in the same order)."""
    folder = save_hf_model(QWEN3.hf_model(), tmp_path)
    options: dict[str, Any] = dict(
        device="cpu", pooling="LAST", enable_prefix_caching=True, compile=False
    )
    eager = padded_cpu_attention(vecpool.Engine(folder, **options))
    compiled = vecpool.Engine(folder, **options)
    compile_blocks(compiled.model, backend="eager")
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    for seed, tail in enumerate([[9, 2, 20, 1], [4, 30], [7, 7, 7]]):
        prompts = _shared(3 * B + 5 + seed, tail)
        for _ in range(2):  # computes the prefix, then reads it from the pool
            want = eager.embed(prompts, normalize=False)
            got = compiled.embed(prompts, normalize=False)
            for a, e in zip(got, want, strict=True):
                assert np.array_equal(a, e)
    assert varlen_on_cpu[0] >= 2 * 3 * 2  # split attention ran, in both engines
    counters = torch._dynamo.utils.counters
    assert not counters["graph_break"]
    assert 1 <= counters["stats"]["unique_graphs"] <= 2


@pytest.mark.parametrize("windowed", [False, True])
def test_graphs_serve_steps_that_read_shared_prefixes(
    varlen_on_cpu: list[int], tmp_path: Path, windowed: bool
) -> None:
    """A step whose whole prompts only read the pool gets a graph, padded as other steps are
    (its groups too), and gives what the engine without graphs gives (within the reordering
    tolerance: padded steps change the products' row counts). A model with sliding windows
    copies cached keys in those layers, which a graph's padded prefix cannot serve: its prefix
    steps run without graphs, results unchanged. On the CPU the same padding runs as plain
    forwards (`capture=False`)."""
    hf = QWEN3.hf_model() if windowed else QWEN3.hf_model(use_sliding_window=False)
    folder = save_hf_model(hf, tmp_path)
    options: dict[str, Any] = dict(device="cpu", pooling="LAST", enable_prefix_caching=True)
    plain = vecpool.Engine(folder, cuda_graphs=False, **options)
    padded = vecpool.Engine(folder, cuda_graphs=True, **options)
    graphs = padded.model_runner.graphs
    assert graphs is not None and not graphs.capture
    for seed, tail in enumerate([[9, 2, 20, 1], [4, 30, 3]]):
        prompts = _shared(3 * B + 5, tail, seed=seed)
        for _ in range(2):  # the first call writes the prefix, the second only reads it
            want = plain.embed(prompts, normalize=False)
            for a, e in zip(padded.embed(prompts, normalize=False), want, strict=True):
                assert_rel_close(a, e, rtol=REORDERED_RTOL)
    prefix_keys = [k for k in graphs.graphs if k.prefix is not None]
    if windowed:
        assert not prefix_keys and not graphs.prefix_enabled
    else:  # every call: the first of a prompt set writes its prefix, the second only reads
        assert graphs.prefix_enabled and graphs.replays == 4
        writes = sorted(k.prefix.writes for k in prefix_keys if k.prefix is not None)
        assert len(writes) == 4 and writes[:2] == [0, 0] and min(writes[2:]) >= 3 * B
