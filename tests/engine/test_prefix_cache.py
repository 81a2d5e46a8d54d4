"""Shared-prefix caching: prompts that start with the same tokens compute them once.

Every output is compared with the same engine without the cache. Not bit-exact in general:
a prompt that starts after a cached prefix attends to the same keys and values, and MEAN adds
the same hidden states, but split otherwise (per-block sums, then the rest; keys laid out by
another gather), so fp32 sums may round differently: compared to 1e-5 of the largest value
(`REORDERED_RTOL`), scores to 1e-4 absolute. The token counts (hit, queried, computed) are
exact numbers worked out from the block size.
"""

from __future__ import annotations

import argparse
import asyncio
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import transformers

import vecpool
from tests.helpers import REORDERED_RTOL, assert_rel_close, random_prompts, save_hf_model
from tests.models.test_decoders import ARCHS, VOCAB
from tests.server.asgi import serving
from tests.tasks.test_scoring import DOCS, QUERY, _word_tokenizer
from vecpool.api.args import EngineArgs
from vecpool.engine.prefix_cache import BLOCK_SIZE, PrefixCache
from vecpool.engine.request import Request
from vecpool.inputs.prompts import Prompt
from vecpool.tasks import TASKS, Head, PoolingParams

B = BLOCK_SIZE
QWEN3 = next(a for a in ARCHS if a.name == "qwen3")  # GQA, q/k norms, a sliding window of 6


@pytest.fixture(scope="module")
def qwen3_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_hf_model(QWEN3.hf_model(), tmp_path_factory.mktemp("qwen3_prefix"))


def _shared(prefix_len: int, tails: list[int], seed: int = 0) -> list[list[int]]:
    """Prompts of one common prefix of `prefix_len` ids and tails of the given lengths."""
    prefix, *rest = random_prompts(VOCAB, [prefix_len, *tails], seed=seed)
    return [prefix + tail for tail in rest]


def _computed_tokens(engine: vecpool.Engine) -> list[int]:
    """Records the tokens of every forward the engine runs (its steps)."""
    runner = engine.model_runner
    seen: list[int] = []
    forward = runner.forward

    def counting(batch: Any) -> Any:
        seen.append(batch.num_tokens)
        return forward(batch)

    runner.forward = counting  # type: ignore[method-assign]
    return seen


# ---- the table alone ---------------------------------------------------------------------


def _request(name: str, ids: list[int], head: str = "embed") -> Request:
    prompt = Prompt(token_ids=np.asarray(ids, dtype=np.int64), prompt_embeds=None)
    return Request(name, prompt, PoolingParams(task=head), TASKS[head])


def test_table_hits_whole_blocks_compares_ids_and_evicts_least_recently_used() -> None:
    cache = PrefixCache(3 * B, frozenset({Head.EMBEDDING}))
    ids = list(range(3, 3 + 3 * B + 5))  # 3 whole blocks and 5 tokens
    first = _request("a", ids)
    cache.admit(first)
    assert first.num_scheduled_tokens == 0 and cache.queried_tokens == len(ids)
    blocks = cache.produce(first, 0, len(ids))
    assert blocks.write_from == 0 and len(blocks.write_slots) == 3 and cache.num_blocks == 3
    # The same ids hit every whole block; a prompt of exactly two blocks hits only one (its
    # last token is always computed: it pools).
    same, short = _request("b", ids), _request("c", ids[: 2 * B])
    cache.admit(same)
    cache.admit(short)
    assert same.num_scheduled_tokens == 3 * B and short.num_scheduled_tokens == B
    assert cache.produce(same, 3 * B, len(ids)).prefix_slots == blocks.write_slots
    # One id changed in the second block: the first block hits, nothing after it.
    other = list(ids)
    other[B + 1] += 1
    changed = _request("d", other)
    cache.admit(changed)
    assert changed.num_scheduled_tokens == B
    assert cache.hit_tokens == 3 * B + B + B
    # Every slot is held by running requests: no block is registered, nothing evicted.
    assert cache.produce(changed, B, len(other)).write_slots == ()
    for r in (first, same, short, changed):
        r.cancel()
    cache.release_done()
    # Now free: a new prompt's blocks take the least recently used slots.
    fresh = _request("e", list(range(60, 60 + 2 * B + 1)))
    cache.admit(fresh)
    assert fresh.num_scheduled_tokens == 0
    assert len(cache.produce(fresh, 0, 2 * B + 1).write_slots) == 2
    # Two of the first prompt's blocks went: its last two, freed before its first (which
    # the requests released last held), so the first block of the prefix stays.
    assert cache.num_blocks == 3
    again = _request("f", ids)
    cache.admit(again)
    assert again.num_scheduled_tokens == B


def test_readers_of_blocks_computed_in_this_step_may_wait_for_the_next() -> None:
    ids = list(range(3, 3 + 2 * B + 3))
    for read_pending in (False, True):
        cache = PrefixCache(8 * B, frozenset({Head.EMBEDDING}), read_pending=read_pending)
        cache.begin_step()
        cache.produce(_admitted(cache, _request("a", ids)), 0, len(ids))
        reader = _request("b", ids)
        assert cache.admit(reader) is read_pending
        assert reader.num_scheduled_tokens == (2 * B if read_pending else 0)
        cache.begin_step()  # the next step: the blocks are computed
        assert cache.admit(reader) and reader.num_scheduled_tokens == 2 * B
        assert cache.queried_tokens == 2 * len(ids) and cache.hit_tokens == 2 * B


def test_prompt_embeds_and_per_token_heads_never_share() -> None:
    cache = PrefixCache(8 * B, frozenset({Head.EMBEDDING}))
    ids = list(range(3, 3 + 2 * B + 1))
    cache.produce(_admitted(cache, _request("a", ids)), 0, len(ids))
    embeds = Request(
        "e",
        Prompt(token_ids=None, prompt_embeds=torch.zeros(len(ids), 4)),
        PoolingParams(),
        TASKS["embed"],
    )
    tokens = _request("t", ids, head="token_embed")
    for r in (embeds, tokens):
        cache.admit(r)
        assert r.num_scheduled_tokens == 0
        assert cache.produce(r, 0, len(ids)).write_slots == ()
    assert cache.queried_tokens == len(ids) and cache.hit_tokens == 0


def _admitted(cache: PrefixCache, request: Request) -> Request:
    cache.admit(request)
    return request


# ---- the engine --------------------------------------------------------------------------


@pytest.mark.parametrize("read_pending", [False, True], ids=["next-step", "same-step"])
@pytest.mark.parametrize("pooling", ["LAST", "MEAN"])
def test_embeddings_equal_those_without_the_cache(
    qwen3_folder: Path, pooling: str, read_pending: bool
) -> None:
    """Readers of a prefix computed in the same step wait for the next (the CPU's padded
    attention) or join it (what the varlen kernel does on CUDA, forced here)."""
    prompts = _shared(3 * B + 5, [9, 2, 20, 1])  # 53 shared ids: 3 whole blocks
    plain = vecpool.Engine(qwen3_folder, device="cpu", pooling=pooling)
    expected = plain.embed(prompts, normalize=False)
    engine = vecpool.Engine(qwen3_folder, device="cpu", pooling=pooling, enable_prefix_caching=True)
    cache = engine.core.scheduler.prefix_cache
    assert cache is not None and not cache.read_pending  # the padded fallback
    cache.read_pending = read_pending
    computed = _computed_tokens(engine)
    for _ in range(2):
        got = engine.embed(prompts, normalize=False)
        for a, b in zip(got, expected, strict=True):
            assert_rel_close(a, b, rtol=REORDERED_RTOL)
    total, longest = sum(map(len, prompts)), max(map(len, prompts))
    # First call: the longest prompt computes the 3 shared blocks, the other three read them
    # (in its step, or the next). Second call: every prompt finds its whole blocks (the
    # longest, 73 ids, its 4 blocks; the others their 3), in one step.
    first_hits = 3 * 3 * B
    second_hits = 4 * B + 3 * 3 * B
    first = [total - first_hits] if read_pending else [longest, total - longest - first_hits]
    assert computed == [*first, total - second_hits]
    assert engine.core.prefix_cache_stats == (first_hits + second_hits, 2 * total)


def test_classifier_scores_equal_those_without_the_cache(tmp_path: Path) -> None:
    torch.manual_seed(0)
    hf = transformers.Qwen3ForSequenceClassification(QWEN3.hf_config(num_labels=3)).eval()
    folder = save_hf_model(hf, tmp_path)
    prompts = _shared(2 * B + 3, [4, 11, 1])
    expected = vecpool.Engine(folder, device="cpu").classify(prompts)
    engine = vecpool.Engine(folder, device="cpu", enable_prefix_caching=True)
    np.testing.assert_allclose(engine.classify(prompts), expected, rtol=0, atol=1e-4)
    assert engine.core.prefix_cache_stats[0] == 2 * 2 * B


def test_chunked_prompts_and_eviction_under_a_small_cache(qwen3_folder: Path) -> None:
    """A token budget of 24: prompts of 70 ids run in chunks, some starting after a cached
    prefix; a cache of 4 blocks holds one prefix's blocks at a time, so prompts of three
    prefixes, alternating, evict each other. Every output matches the engine without cache."""
    groups = [_shared(3 * B + 2, [20, 8], seed=s) for s in range(3)]
    prompts = [p for round_ in zip(*groups, strict=True) for p in round_] * 2  # a, b, c, a, ...
    plain = vecpool.Engine(qwen3_folder, device="cpu", pooling="MEAN", max_num_batched_tokens=24)
    engine = vecpool.Engine(
        qwen3_folder,
        device="cpu",
        pooling="MEAN",
        max_num_batched_tokens=24,
        enable_prefix_caching=True,
        prefix_cache_tokens=4 * B,
    )
    cache = engine.core.scheduler.prefix_cache
    assert cache is not None and cache.num_slots == 4
    expected = {tuple(p): plain.embed([p], normalize=False)[0] for p in prompts}
    for prompt in prompts:  # one call each: the table changes between them
        got = engine.embed([prompt], normalize=False)[0]
        assert_rel_close(got, expected[tuple(prompt)], rtol=REORDERED_RTOL)
    # Chunks of 24 end inside blocks, so a prompt registers only the whole blocks of its
    # first computed chunk. Worked through (a, b, c: the prefixes; 70 and 58 ids; blocks are
    # let go in the order of their release, least recently used evicted):
    # round 1: a70 b70 c70 miss and register block 0 each; a58 hits a0 (16) and registers a1;
    #   b58 hits b0 (16), registers b1, evicting c0; c58 misses, registers c0 (evicts a0).
    # round 2: a70 misses (a0 went), registers a0 (evicts a1); b70 hits b0 b1 (32) and
    #   registers b2 (evicts c0); c70 misses, registers c0 (evicts a0); a58 misses, registers
    #   a0 (evicts b0); b58 misses, registers b0 (evicts b1); c58 hits c0 (16).
    assert engine.core.prefix_cache_stats == (16 + 16 + 32 + 16, sum(map(len, prompts)))
    assert cache.num_blocks == 4


def test_llm_reranker_computes_the_shared_query_once(tmp_path: Path) -> None:
    """A rerank call: the template, instruction and query before each document are one
    prefix; it is computed once (by the first prompt), the other documents reading it."""
    hf = QWEN3.hf_model(causal_lm=True, tie_word_embeddings=False)
    folder = save_hf_model(hf, tmp_path)
    _word_tokenizer(folder)
    config = vecpool.LLMRerankerConfig.qwen3(instruction="find what cats eat")
    plain = vecpool.Engine(folder, device="cpu", llm_reranker=config)
    engine = vecpool.Engine(folder, device="cpu", llm_reranker=config, enable_prefix_caching=True)
    computed = _computed_tokens(engine)
    np.testing.assert_allclose(
        engine.score(QUERY, DOCS, use_activation=False),
        plain.score(QUERY, DOCS, use_activation=False),
        rtol=0,
        atol=1e-4,
    )
    ranked, expected = engine.rerank(QUERY, DOCS), plain.rerank(QUERY, DOCS)
    assert [i for i, _ in ranked] == [i for i, _ in expected]
    ids = [engine.tokenize(config.format(QUERY, d)) for d in DOCS]
    shared = 0
    while len({tuple(p[: shared + 1]) for p in ids}) == 1:
        shared += 1
    assert len({p[shared] for p in ids}) == len(DOCS)  # no two share more than the query
    assert shared >= 2 * B
    # The longest prompt computes everything; each other one reads the whole blocks of the
    # shared part. Both calls run in one step each; the second reads the same as the first
    # and the first prompt its blocks too.
    longest = max(range(len(ids)), key=lambda i: len(ids[i]))
    hits = B * sum(min(shared // B, (len(p) - 1) // B) for i, p in enumerate(ids) if i != longest)
    total = sum(map(len, ids))
    # The longest prompt in a step of its own, the rest of the documents in the next.
    assert computed[:2] == [len(ids[longest]), total - len(ids[longest]) - hits]
    assert engine.core.prefix_cache_stats[1] == 2 * total


def test_prompt_embeds_never_hit(qwen3_folder: Path) -> None:
    prompts = _shared(2 * B + 4, [3, 5])
    engine = vecpool.Engine(qwen3_folder, device="cpu", enable_prefix_caching=True)
    plain = vecpool.Engine(qwen3_folder, device="cpu")
    engine.embed(prompts)  # the table now holds the shared blocks
    embeds = [engine.model_runner.embed_tokens(torch.tensor(p)).cpu() for p in prompts]
    before = engine.core.prefix_cache_stats
    got = engine.embed([{"prompt_embeds": e} for e in embeds])
    assert engine.core.prefix_cache_stats == before  # neither queried nor hit
    for a, b in zip(got, plain.embed(prompts), strict=True):
        assert_rel_close(a, b, rtol=REORDERED_RTOL)


def test_bidirectional_models_refuse_prefix_caching(default_model_dir: Path) -> None:
    with pytest.raises(vecpool.ConfigError, match=r"enable_prefix_caching.*both directions"):
        vecpool.Engine(default_model_dir, device="cpu", enable_prefix_caching=True)


def test_metrics_count_hit_and_queried_tokens(qwen3_folder: Path) -> None:
    engine = vecpool.Engine(qwen3_folder, device="cpu", enable_prefix_caching=True)
    prompts = _shared(2 * B + 1, [2, 7])  # 35 and 40 ids: the second reads 2 blocks

    async def run() -> str:
        async with serving(engine) as (client, _):
            response = await client.post("/v1/embeddings", json={"input": prompts})
            assert response.status_code == 200, response.text
            return (await client.get("/metrics")).text

    text = asyncio.run(run())
    assert "vecpool_prefix_cache_hit_tokens_total 32.0" in text
    assert f"vecpool_prefix_cache_queried_tokens_total {float(35 + 40)}" in text


def test_cli_flags_build_the_cache(qwen3_folder: Path) -> None:
    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    args = EngineArgs.from_cli_args(
        parser.parse_args(
            [str(qwen3_folder), "--enable-prefix-caching", "--prefix-cache-tokens", "40"]
        )
    )
    assert (args.enable_prefix_caching, args.prefix_cache_tokens) == (True, 40)
    engine = vecpool.Engine.from_args(replace(args, device="cpu"))
    cache = engine.core.scheduler.prefix_cache
    assert cache is not None and cache.num_slots == 40 // B
    assert EngineArgs(qwen3_folder).prefix_cache_size(128) == 8192
    off = vecpool.Engine(qwen3_folder, device="cpu")
    assert off.core.scheduler.prefix_cache is None and off.core.prefix_cache_stats == (0, 0)
    with pytest.raises(vecpool.ConfigError, match="holds no block of 16 tokens"):
        vecpool.Engine(
            qwen3_folder, device="cpu", enable_prefix_caching=True, prefix_cache_tokens=15
        )


def test_a_failed_step_leaves_no_block_to_read(qwen3_folder: Path) -> None:
    """A step that fails as a whole runs again in halves; the blocks it registered are dropped
    from the table, so a later call computes its prefix again rather than reading rows a
    failed forward may have left half written."""
    engine = vecpool.Engine(qwen3_folder, device="cpu", enable_prefix_caching=True)
    cache = engine.core.scheduler.prefix_cache
    assert cache is not None
    cache.read_pending = True  # the reader shares the producer's step: the halves split them
    prompts = _shared(2 * B + 3, [4, 6])
    runner = engine.model_runner
    forward, calls = runner.forward, []

    def fails_once(batch: Any) -> Any:
        calls.append(batch.num_tokens)
        if len(calls) == 1:
            raise RuntimeError("device error")
        return forward(batch)

    runner.forward = fails_once  # type: ignore[method-assign]
    expected = vecpool.Engine(qwen3_folder, device="cpu").embed(prompts)
    assert_rel_close(np.array(engine.embed(prompts)), np.array(expected), rtol=REORDERED_RTOL)
    assert calls == [48, 41, 7]  # the step, then its halves: the producer, the reader
    assert cache.num_blocks == 0
    hit_before = engine.core.prefix_cache_stats[0]
    engine.embed(prompts)
    assert engine.core.prefix_cache_stats[0] == hit_before + 2 * B  # the shorter one reads 2
