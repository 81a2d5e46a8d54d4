"""Where the time of one cached LLM-reranker call goes (shared-prefix caching, CUDA): the
call's wall time, how much of it is tokenizing, the device's busy time, the heaviest kernels
and host functions.

    PYTHONPATH=. python benchmarks/profile_prefix.py --tokenizer DIR [--compile --cuda-graphs]

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


if __name__ == "__main__":
    main()
