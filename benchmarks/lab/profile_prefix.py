"""Where the time of one cached LLM-reranker call goes (shared-prefix caching, CUDA): the
call's wall time, how much of it is tokenizing, the device's busy time, the heaviest kernels
and host functions.

    PYTHONPATH=. python benchmarks/lab/profile_prefix.py --tokenizer DIR [--compile --cuda-graphs]

The model and the call are bench_prefix.py's (a Qwen3-Reranker-0.6B shape with random weights,
100 documents of U[10, 40] words against a ~400-word query).
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import pstats
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.profiler import ProfilerActivity, profile

import vecpool
from benchmarks.bench_prefix import SHAPES, text, write_folder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-reranker-0.6b")
    parser.add_argument("--documents", type=int, default=100)
    parser.add_argument("--query-tokens", type=int, default=400)
    parser.add_argument("--tokenizer", type=Path)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--cuda-graphs", action="store_true")
    args = parser.parse_args()
    gen = np.random.default_rng(0)

    def sync() -> None:
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()

    config = vecpool.LLMRerankerConfig.qwen3(instruction="Given a query, find passages about it")
    with tempfile.TemporaryDirectory() as tmp:
        folder = write_folder(
            SHAPES[args.shape], Path(tmp), args.device, torch.bfloat16, args.tokenizer
        )
        engine = vecpool.Engine(
            folder,
            device=args.device,
            dtype=torch.bfloat16,
            llm_reranker=config,
            compile=args.compile,
            cuda_graphs=args.cuda_graphs,
            max_model_len=2048,
            enable_prefix_caching=True,
        )

        def call() -> tuple[str, list[str]]:
            docs = [text(gen, int(n)) for n in gen.integers(10, 40, size=args.documents)]
            return text(gen, args.query_tokens), docs

        for _ in range(3):
            engine.score(*call())
        gc.collect()
        gc.freeze()  # as bench_prefix.py and `vecpool serve` do
        phases = _time_phases(engine)
        walls, tokenize, steps = [], [], []
        for _ in range(5):
            query, docs = call()
            prompts = [config.format(query, d) for d in docs]
            started = time.perf_counter()
            engine.context.tokenizer.encode_batch(prompts)  # type: ignore[union-attr]
            tokenize.append(time.perf_counter() - started)
            before = engine.core.num_steps
            sync()
            started = time.perf_counter()
            engine.score(query, docs)
            sync()
            walls.append(time.perf_counter() - started)
            steps.append(engine.core.num_steps - before)
        print(f"call wall s {[round(w, 4) for w in walls]} median {statistics.median(walls):.4f}")
        print(
            f"tokenize s {[round(t, 4) for t in tokenize]} median {statistics.median(tokenize):.4f}"
        )
        print(f"steps per call {steps}")
        print("host seconds per call, by phase (median of the 5 calls; pool waits for the device):")
        for name, values in phases.items():
            print(
                f"  {name}: {statistics.median(values[-5:]):.4f}  {[round(v, 4) for v in values[-5:]]}"
            )
        query, docs = call()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            engine.score(query, docs)
            sync()
        events = prof.key_averages()
        busy = sum(e.self_device_time_total for e in events)
        print(f"device busy {busy / 1e3:.2f} ms in the profiled call")
        print(events.table(sort_by="self_cuda_time_total", row_limit=15))
        print(events.table(sort_by="self_cpu_time_total", row_limit=25))
        profiler = cProfile.Profile()
        query, docs = call()
        profiler.runcall(engine.score, query, docs)
        pstats.Stats(profiler).sort_stats("tottime").print_stats(30)
        pstats.Stats(profiler).sort_stats("cumulative").print_stats(30)


def _time_phases(engine: vecpool.Engine) -> dict[str, list[float]]:
    """Wrap the engine's phases to record each call's host seconds in each (a phase that runs
    several times in a call adds up)."""
    phases: dict[str, list[float]] = {}
    targets = {
        "prepare_score (tokenize, validate)": (engine, "prepare_score"),
        "schedule": (engine.core.scheduler, "schedule"),
        "build batch": (engine.model_runner, "prepare"),
        "forward (launch)": (engine.model_runner, "forward"),
        "pool (waits for the device)": (engine.core.pooling_runner, "pool"),
    }
    calls = [0]

    def wrap(name: str, fn: Any) -> Any:
        def timed(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                values = phases.setdefault(name, [])
                while len(values) <= calls[0]:
                    values.append(0.0)
                values[calls[0]] += time.perf_counter() - started

        return timed

    for name, (owner, attr) in targets.items():
        setattr(owner, attr, wrap(name, getattr(owner, attr)))
    score = engine.score

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        return score(*args, **kwargs)

    engine.score = counted  # type: ignore[method-assign]
    return phases


if __name__ == "__main__":
    main()
