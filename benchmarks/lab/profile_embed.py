"""Where the time of one large `Engine.embed` call goes, on CUDA: wall time, the device's busy
time, and the heaviest kernels and host functions.

    PYTHONPATH=. python benchmarks/lab/profile_embed.py --model DIR [--synthetic KIND] [--n 20000]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import tempfile
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

import vecpool
from benchmarks.bench_embed import SYNTHETIC, make_synthetic_folder
from vecpool.cli.bench import make_texts


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--synthetic", choices=SYNTHETIC)
    parser.add_argument("--n", type=int, default=20000)
    parser.add_argument("--max-num-batched-tokens", type=int, default=16384)
    args = parser.parse_args()
    folder = args.model
    if args.synthetic:
        folder = make_synthetic_folder(args.synthetic, Path(tempfile.mkdtemp()), args.model)
    engine = vecpool.Engine(
        folder, device="cuda", max_num_batched_tokens=args.max_num_batched_tokens
    )
    texts = make_texts(args.n)
    engine.embed(texts[:2000], truncate_prompt_tokens=-1)

    def run() -> None:
        engine.embed(texts, truncate_prompt_tokens=-1, show_progress=False)

    torch.cuda.synchronize()
    start = time.perf_counter()
    run()
    torch.cuda.synchronize()
    wall = time.perf_counter() - start
    steps = engine.core.num_steps
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        run()
    steps = engine.core.num_steps - steps
    events = prof.key_averages()
    device_us = sum(e.self_device_time_total for e in events)
    print(
        f"wall {wall:.3f} s for {args.n} inputs in {steps} steps; device busy {device_us / 1e6:.3f} s"
    )
    print(events.table(sort_by="self_cuda_time_total", row_limit=12))
    profiler = cProfile.Profile()
    profiler.runcall(run)
    pstats.Stats(profiler).sort_stats("tottime").print_stats(18)


if __name__ == "__main__":
    main()
