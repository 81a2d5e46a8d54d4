"""Prepared calls run on the async front: prepare (in a thread), `AsyncEngine.run`, finish."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import vecpool
from tests.tasks.test_scoring import DOCS, QUERY
from vecpool.api.async_engine import AsyncEngine


def _run_async(engine: vecpool.Engine, prepare: Any, *args: Any, **kwargs: Any) -> Any:
    async def main() -> Any:
        front = AsyncEngine(engine)
        front.start()
        try:
            call = await asyncio.to_thread(prepare, *args, **kwargs)
            return call.finish(await front.run(call.requests))
        finally:
            front.shutdown()

    return asyncio.run(main())


def test_prepared_calls_on_the_async_front(
    cross_encoder_engine: vecpool.Engine,
    splade_engine: vecpool.Engine,
    colbert: tuple[Path, Any, Any],
) -> None:
    # Bit for bit: both paths queue a call's requests together, longest first, so the async
    # front runs the same batch as the blocking call.
    ce = cross_encoder_engine
    assert _run_async(ce, ce.prepare_rerank, QUERY, DOCS, 2) == ce.rerank(QUERY, DOCS, 2)
    assert (_run_async(ce, ce.prepare_score, QUERY, DOCS) == ce.score(QUERY, DOCS)).all()
    pairs = [{"text": QUERY, "text_pair": d} for d in DOCS]
    assert (_run_async(ce, ce.prepare_classify, pairs) == ce.classify(pairs)).all()
    sparse = _run_async(splade_engine, splade_engine.prepare_embed_sparse, DOCS, top_k=8)
    assert sparse == splade_engine.embed_sparse(DOCS, top_k=8)
    late = vecpool.Engine(colbert[0], device="cpu")
    assert _run_async(late, late.prepare_rerank, QUERY, DOCS) == late.rerank(QUERY, DOCS)
