"""The engine's host cost per input: `Engine.embed` of `bench_gpu.py`'s workloads with the
model's forward replaced by a stub that returns zeros, so that what is timed is everything but
the model: preparing the inputs, requests, scheduling, batches, pooling, finishing, results.

    PYTHONPATH=. python benchmarks/lab/bench_host.py [--n 4096] [--rounds 7] [--output FILE]

On a GPU the forward runs on the device while the host does this, so for short inputs this
cost, not the device, sets the pace (`profile_phases.py`). The model is a one-layer BERT of
hidden size 32 with the packaged MiniLM's tokenizer, on the CPU; its pooling runs for real.
Rounds alternate the inputs' forms (ids, text); the figure is microseconds per input, the
median of the rounds, each round kept.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import tokenizers
import torch

import vecpool
from benchmarks import record
from benchmarks.workloads import (
    SHAPES,
    WORKLOADS,
    Shape,
    make_inputs,
    workload_lengths,
    write_folder,
)
from vecpool.api import default_model_path

HIDDEN = 32


def stub_engine(tokenizer_dir: Path, max_num_seqs: int = 1024) -> vecpool.Engine:
    """An engine on the CPU whose forward returns zeros of the hidden size at once."""
    base = SHAPES["tiny-bert"]
    config = dict(
        base.config,
        num_hidden_layers=1,
        hidden_size=HIDDEN,
        num_attention_heads=2,
        intermediate_size=HIDDEN,
    )
    shape = Shape(base.config_class, base.model_class, config, causal=False)
    folder = write_folder(shape, Path(tempfile.mkdtemp()), tokenizer_dir, "cpu")
    engine = vecpool.Engine(
        folder, device="cpu", max_num_batched_tokens=32768, max_num_seqs=max_num_seqs
    )

    def forward(batch: Any) -> torch.Tensor:
        return torch.zeros(batch.num_tokens, HIDDEN)

    engine.model_runner.forward = forward  # type: ignore[method-assign]
    return engine


def main(argv: list[str]) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--n", type=int, default=4096)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=WORKLOADS)
    parser.add_argument("--tokenizer", type=Path, default=None, help="default: packaged MiniLM")
    parser.add_argument("--output", type=Path)
    record.add_args(parser)
    args = parser.parse_args(argv)
    tokenizer_dir = args.tokenizer or default_model_path()
    report: dict[str, Any] = record.header(
        "lab/bench_host.py", argv, device="cpu", commit=args.commit
    )
    report["unit"] = "microseconds per input"
    engine = stub_engine(tokenizer_dir)
    tokenizer = tokenizers.Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    results: dict[str, Any] = {}
    for workload in args.workloads:
        lengths = workload_lengths(workload, args.n).clip(max=engine.info().max_model_len)
        texts, ids = make_inputs(tokenizer, lengths)
        forms = {"ids": ids, "text": texts}
        for inputs in forms.values():
            engine.embed(inputs[:512], show_progress=False)
        gc.collect()
        gc.freeze()
        rounds: dict[str, list[float]] = {form: [] for form in forms}
        for _ in range(args.rounds):
            for form, inputs in forms.items():
                started = time.perf_counter()
                engine.embed(inputs, show_progress=False)
                rounds[form].append((time.perf_counter() - started) / len(inputs) * 1e6)
        gc.unfreeze()
        results[workload] = {
            "num_inputs": len(ids),
            "num_tokens": int(lengths.sum()),
            **{
                form: {"median": statistics.median(values), "rounds": values}
                for form, values in rounds.items()
            },
        }
        print(
            workload,
            {form: round(statistics.median(values), 1) for form, values in rounds.items()},
            flush=True,
        )
    report["workloads"] = results
    record.write(args.output, report)
    return report


if __name__ == "__main__":
    main(sys.argv[1:])
