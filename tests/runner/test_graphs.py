"""Steps padded to the shapes of CUDA graphs (graphs.py), checked on the CPU.

CI has no GPU, so nothing is recorded here: with `capture=False` the runner pads each step to
its shape key and runs the forward on the static buffers, which is exactly what a graph replays.
What these tests prove is the padding: the real rows of a padded step equal the same step run
unpadded, whatever the mix of lengths; prompt embeds stay bit-exact with ids; steps a graph
cannot serve (chunks of long prompts, too many tokens) run as before. Padded and unpadded runs
differ in the shapes of their kernels (more rows, a longer padded attention layout), so they
are compared within REORDERED_RTOL, the stated bound for the same fp32 arithmetic reordered.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pytest
import torch

import vecpool
from tests.helpers import (
    REORDERED_RTOL,
    assert_rel_close,
    engine_hidden,
    random_prompts,
)
from tests.runner.conftest import VOCAB
from vecpool.models.layers.attention import AttentionMetadata, GraphUnsupported, flat_attention
from vecpool.runner.batch import FlatBatch
from vecpool.runner.graphs import ShapeKey, StepGraphs, _Graph, graph_max_tokens, token_buckets


def test_token_buckets_cover_every_count_with_bounded_padding() -> None:
    sizes = token_buckets(8192)
    assert sizes[0] == 16 and sizes[-1] == 8192
    assert all(a < b for a, b in itertools.pairwise(sizes))
    # From 128 up, a step is padded by at most a quarter of the bucket below it.
    assert all(b / a <= 1.25 + 1e-9 for a, b in itertools.pairwise(sizes) if a >= 128)
    assert sizes[:12] == [16, 32, 64, 128, 160, 192, 224, 256, 320, 384, 448, 512]
    assert 640 in sizes and 1280 in sizes
    assert token_buckets(100)[-1] == 100


def test_narrow_models_graph_steps_up_to_their_budget() -> None:
    assert graph_max_tokens(1024, 65536) == 8192  # wide: launching is a small share
    assert graph_max_tokens(4096, None) == 8192
    assert graph_max_tokens(384, 16384) == 16384  # narrow: the budget
    assert graph_max_tokens(768, 65536) == 32768  # at most 32,768
    assert graph_max_tokens(384, 2048) == 8192  # never fewer than before
    assert graph_max_tokens(384, None) == 8192
    assert token_buckets(graph_max_tokens(384, 32768))[-1] == 32768


def test_large_buckets_keep_few_empty_sequence_slots() -> None:
    """Up to 8192 tokens a key has a slot per 8 tokens at least (one key per bucket and
    length serves most steps); above, as many as sequences of half its length fill, since
    each empty slot costs the attention kernel blocks (at 32,768 tokens one per 8 would be
    4096 slots for a step of 128 passages)."""
    graphs = StepGraphs(
        lambda *a: a[0],
        hidden_size=8,
        dtype=torch.float32,
        device=torch.device("cpu"),
        max_seqs=1024,
        max_model_len=512,
        use_varlen=False,
        with_token_types=False,
        max_tokens=32768,
        capture=False,
    )
    assert graphs.key(8000, 31, 300) == ShapeKey(8192, 1024, 512)  # as before: 8192 / 8
    assert graphs.key(32000, 125, 512) == ShapeKey(32768, 256, 512)  # 128 passages of 256
    assert graphs.key(32000, 250, 256) == ShapeKey(32768, 512, 256)
    assert graphs.key(30000, 900, 60) == ShapeKey(32768, 2048, 64)  # queries: all 1024 seqs
    assert graphs.key(12000, 600, 200) == ShapeKey(12288, 1024, 256)  # more than the fewest
    assert graphs.key(32768, 1024, 40) is not None and graphs.key(32769, 10, 40) is None


@pytest.mark.parametrize("kind", ["qwen3", "bert"])
def test_padded_steps_match_unpadded_and_keep_embeds_exact(
    kind: str, qwen3_folder: Path, tiny_bert: tuple[Path, object]
) -> None:
    folder = qwen3_folder if kind == "qwen3" else tiny_bert[0]
    vocab = VOCAB if kind == "qwen3" else 99
    plain = vecpool.Engine(folder, device="cpu", cuda_graphs=False)
    padded = vecpool.Engine(folder, device="cpu", cuda_graphs=True)
    graphs = padded.model_runner.graphs
    assert plain.model_runner.graphs is None and graphs is not None
    for seed, lengths in enumerate([[5, 17, 3, 30], [1], [40, 9, 9, 1, 12, 2, 2, 8, 60]]):
        prompts = random_prompts(vocab, lengths, seed=seed)
        expected = engine_hidden(plain, prompts)
        as_ids = engine_hidden(padded, prompts)
        as_embeds = engine_hidden(
            padded, [{"prompt_embeds": padded.embed_tokens(p)} for p in prompts]
        )
        for e, a, b in zip(expected, as_ids, as_embeds, strict=True):
            assert_rel_close(a, e, REORDERED_RTOL)
            assert np.array_equal(a, b)
    assert graphs.replays == 6  # every step above was served padded
    keys = set(graphs.graphs)
    assert {k.tokens for k in keys} == {16, 64, 160}  # 55, 1 and 143 tokens, rounded up
    assert all(k.seqs & (k.seqs - 1) == 0 and k.max_len >= 64 for k in keys)
    # The varlen kernel reads every slot's boundaries: after a step of nine sequences, one of
    # a single sequence must leave every other slot empty at its end (the padded fallback on
    # the CPU does not read them, so this is checked on the buffer itself).
    engine_hidden(padded, random_prompts(vocab, [7]))
    assert graphs.cu_seqlens[:2].tolist() == [0, 7]
    assert (graphs.cu_seqlens[1:] == 7).all()
    # Its padding rows (7-16) are zero, whatever the step before (143 tokens) left there:
    # compiled decoder layers on CUDA write their residual sums into the static input,
    # padding rows included (`layers.add_linear`).
    assert graphs.x[:7].any() and not graphs.x[7:16].any()


def test_steps_a_graph_cannot_serve_run_unpadded(qwen3_folder: Path) -> None:
    """Chunks of a prompt over the budget (cached keys), steps over the largest bucket, and
    new shapes once `max_graphs` are recorded run without padding, with the same results."""
    plain = vecpool.Engine(qwen3_folder, device="cpu", cuda_graphs=False, max_num_batched_tokens=64)
    padded = vecpool.Engine(qwen3_folder, device="cpu", cuda_graphs=True, max_num_batched_tokens=64)
    runner = padded.model_runner
    runner.graphs = graphs = StepGraphs(
        padded.model,
        hidden_size=padded.hidden_size,
        dtype=torch.float32,
        device=torch.device("cpu"),
        max_seqs=4,
        max_model_len=padded.max_model_len,
        use_varlen=False,
        with_token_types=False,
        max_tokens=32,
        max_graphs=1,
        capture=False,
    )
    # 150 tokens: chunks of 64, 64, 22 with cached keys; 40 tokens: over 32; then two small
    # steps of different shapes: the first gets the one graph, the second runs unpadded.
    for prompts in ([random_prompts(VOCAB, [150])[0]], random_prompts(VOCAB, [20, 20], 1)):
        for e, a in zip(engine_hidden(plain, prompts), engine_hidden(padded, prompts), strict=True):
            assert np.array_equal(a, e)
    assert graphs.replays == 0
    for lengths in ([3, 4], [20]):
        prompts = random_prompts(VOCAB, lengths, seed=2)
        for e, a in zip(engine_hidden(plain, prompts), engine_hidden(padded, prompts), strict=True):
            assert_rel_close(a, e, REORDERED_RTOL)
    assert graphs.replays == 1 and len(graphs.graphs) == 1
    # Five sequences: more than the slots (4 + one for the padding rows make 8, minus one).
    assert graphs.key(10, 8, 3) is None and graphs.key(10, 7, 3) is not None


def test_recording_refuses_the_padded_attention_fallback() -> None:
    """A graph replays fixed shapes: the padded fallback, whose layout depends on the step,
    must refuse to be recorded (soft-capping models run without graphs)."""
    q = torch.randn(6, 2, 4)
    meta = AttentionMetadata(
        cu_seqlens=torch.tensor([0, 6], dtype=torch.int32),
        max_seqlen=6,
        seq_ids=torch.zeros(6, dtype=torch.int64),
        pos_in_seq=torch.arange(6),
        use_varlen=False,
        static=True,
    )
    with pytest.raises(GraphUnsupported, match="padded fallback"):
        flat_attention(q, q, q, meta, causal=True, scale=0.5)
    meta.static = False
    assert flat_attention(q, q, q, meta, causal=True, scale=0.5).shape == q.shape


def test_warm_up_records_every_bucket_with_common_lengths(qwen3_folder: Path) -> None:
    engine = vecpool.Engine(qwen3_folder, device="cpu", cuda_graphs=True)
    graphs = engine.model_runner.graphs
    assert graphs is not None and not graphs.graphs  # on the CPU nothing is recorded at start
    graphs.warm_up()
    keys = set(graphs.graphs)
    # Buckets 16..8192; lengths 64..256 (the model's limit is 256), each at most the bucket
    # (or 64): 16, 32 and 64 with one length, 128..224 with two, the rest with three.
    assert graphs.buckets[:8] == [16, 32, 64, 128, 160, 192, 224, 256]
    assert len(keys) == 3 + 2 * 4 + 3 * (len(graphs.buckets) - 7)
    assert {k.max_len for k in keys} == {64, 128, 256}
    # A later step of a recorded shape takes its entry: no new key.
    engine_hidden(engine, random_prompts(VOCAB, [30, 30, 30, 30, 30]))
    assert set(graphs.graphs) == keys and graphs.replays == 1


def test_steps_of_short_sequences_are_marked_for_packed_attention(qwen3_folder: Path) -> None:
    """The runner marks a step packed when its longest sequence is within the limit, a
    recorded shape when its `max_len` is; on the CPU (no kernel) the limit is 0 and a marked
    step runs the same fallback, so its rows are the same bits."""
    engine = vecpool.Engine(qwen3_folder, device="cpu", cuda_graphs=False)
    runner = engine.model_runner
    assert runner.packed_max_len == 0  # no varlen kernel here: never packed
    prompts = [random_prompts(VOCAB, [5, 9], seed=1), random_prompts(VOCAB, [5, 17], seed=2)]
    before = [engine_hidden(engine, p) for p in prompts]
    runner.packed_max_len = 10
    seen: list[tuple[int, bool]] = []
    forward = runner.forward

    def spy(batch: FlatBatch) -> torch.Tensor:
        seen.append((batch.attn.max_seqlen, batch.attn.packed))
        return forward(batch)

    runner.forward = spy  # type: ignore[method-assign]
    after = [engine_hidden(engine, p) for p in prompts]
    assert seen == [(9, True), (17, False)]
    for b, a in zip(itertools.chain(*before), itertools.chain(*after), strict=True):
        assert np.array_equal(a, b)
    graphs = StepGraphs(
        lambda *a: a[0],
        hidden_size=8,
        dtype=torch.float32,
        device=torch.device("cpu"),
        max_seqs=16,
        max_model_len=512,
        use_varlen=True,
        with_token_types=False,
        packed_max_len=128,
        capture=False,
    )
    assert graphs._metadata(ShapeKey(64, 8, 128), _Graph(None)).packed
    assert not graphs._metadata(ShapeKey(512, 8, 256), _Graph(None)).packed
