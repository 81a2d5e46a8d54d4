"""Engine settings against each other, in one process on the same texts: median seconds of a
large `Engine.embed` call per (token budget, request cap, pipelined tokenization).

    PYTHONPATH=. python benchmarks/lab/sweep_embed.py --model DIR [--synthetic KIND] [--n 20000]
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

import vecpool
import vecpool.api.running
from benchmarks.bench_embed import SYNTHETIC, make_synthetic_folder
from vecpool.cli.bench import make_texts


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--synthetic", choices=SYNTHETIC)
    parser.add_argument("--n", type=int, default=20000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--budgets", default="16384,32768")
    parser.add_argument("--seq-caps", default="256,1024")
    args = parser.parse_args()
    folder = (
        make_synthetic_folder(args.synthetic, Path(tempfile.mkdtemp()), args.model)
        if args.synthetic
        else args.model
    )
    texts = make_texts(args.n)
    pipeline_chunk = vecpool.api.running.PIPELINE_CHUNK
    rows = []
    for budget, cap in itertools.product(
        map(int, args.budgets.split(",")), map(int, args.seq_caps.split(","))
    ):
        engine = vecpool.Engine(
            folder, device="cuda", max_num_batched_tokens=budget, max_num_seqs=cap
        )
        engine.embed(texts[:1000], truncate_prompt_tokens=-1)
        for pipelined in (True, False):
            vecpool.api.running.PIPELINE_CHUNK = pipeline_chunk if pipelined else 10**9
            times = []
            for _ in range(args.repeats):
                torch.cuda.synchronize()
                start = time.perf_counter()
                engine.embed(texts, truncate_prompt_tokens=-1, show_progress=False)
                torch.cuda.synchronize()
                times.append(time.perf_counter() - start)
            row = {
                "budget": budget,
                "max_num_seqs": cap,
                "pipelined": pipelined,
                "median_s": statistics.median(times),
                "seconds": times,
            }
            print(json.dumps(row), flush=True)
            rows.append(row)
        vecpool.api.running.PIPELINE_CHUNK = pipeline_chunk


if __name__ == "__main__":
    main()
