"""Shared-prefix caching on an LLM reranker: one rerank call, with and without the cache.

    PYTHONPATH=. python benchmarks/bench_prefix.py --output benchmarks/results/prefix_cpu.json
    PYTHONPATH=. python benchmarks/bench_prefix.py --device cuda --shape qwen3-reranker-0.6b \
        --documents 100 --output benchmarks/results/prefix_h200.json

A Qwen3 causal LM with random weights (`--shape`: `qwen3-minilm`, a Qwen3 of all-MiniLM-L6-v2's
size, 6 layers of width 384, for the CPU; `qwen3-reranker-0.6b`, Qwen3-Reranker-0.6B's shape,
28 layers of width 1024) serves as a reranker through `LLMRerankerConfig.qwen3` and the packaged
tokenizer. Each round scores `--documents` short documents (U[10, 40] words) against a query of
about `--query-tokens` tokens; every round has a query of its own, so a round gains only from
what its own call shares (the template, instruction and query before each document), nothing
from earlier rounds. Two engines on the same folder, one with `enable_prefix_caching`, run the
same rounds, alternating. Reported: every round's seconds, the medians, the speedup, the
largest difference of the scores (sigmoid) and of the raw log-odds between the two, in
bfloat16 each one's largest log-odds error against a float32 engine without the cache, and the
cache's hit and queried tokens. float32 on the CPU, bfloat16 on CUDA.

The script fails (non-zero exit, the reason printed) when the device asked for is not there,
when the cache served no token, or on the CPU in float32 when a score differs by more than
1e-4 (in bfloat16 the two differ by the dtype's rounding of a different split of the same sums:
reported, not checked).
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import vecpool
from benchmarks import record
from benchmarks.workloads import SHAPES as WORKLOAD_SHAPES
from vecpool.api import default_model_path

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.txt")
SHAPES: dict[str, dict[str, Any]] = {
    "qwen3-minilm": dict(
        vocab_size=30522,  # the packaged tokenizer's
        hidden_size=384,
        num_hidden_layers=6,
        num_attention_heads=6,
        num_key_value_heads=2,
        head_dim=64,
        intermediate_size=1536,
        tie_word_embeddings=True,
    ),
    # Qwen3-Reranker-0.6B is Qwen3-0.6B's shape (write_folder sets the decoder's other fields).
    "qwen3-reranker-0.6b": {
        k: v
        for k, v in WORKLOAD_SHAPES["qwen3-0.6b"].config.items()
        if k not in ("max_position_embeddings", "rms_norm_eps")
    },
}
WORDS = (
    "cat dog fish bird tree river stone cloud market price city road house light water fire "
    "paper music table window garden winter summer morning evening doctor teacher student "
    "engine metal glass bread apple orange green blue small large quick slow open close"
).split()


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-minilm")
    parser.add_argument("--documents", type=int, default=32)
    parser.add_argument("--query-tokens", type=int, default=400)
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds (at least 3)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--compile", action="store_true", help="compile both engines")
    parser.add_argument("--cuda-graphs", action="store_true", help="CUDA graphs on both")
    parser.add_argument("--output", type=Path)
    parser.add_argument("--tokenizer", type=Path, help="default: the packaged model's folder")
    record.add_args(parser)
    args = parser.parse_args(argv)
    if args.rounds < record.MIN_ROUNDS:
        parser.error("--rounds must be at least 3 (the median of 3 or more)")
    return args


def write_folder(
    shape: dict[str, Any],
    dest: Path,
    device: str,
    dtype: torch.dtype,
    tokenizer_dir: Path | None = None,
) -> Path:
    """A Qwen3ForCausalLM of `shape`, random weights (drawn on `device`), and the tokenizer of
    `tokenizer_dir` (default: the packaged model's)."""
    torch.manual_seed(0)
    config = transformers.Qwen3Config(max_position_embeddings=32768, rms_norm_eps=1e-6, **shape)
    with torch.device(device):
        model = transformers.Qwen3ForCausalLM(config)
        torch.nn.Module.to(model, dtype)  # (transformers types its own `to` oddly)
    model.save_pretrained(str(dest), safe_serialization=True)
    del model
    tokenizer_dir = tokenizer_dir or default_model_path()
    for name in TOKENIZER_FILES:
        (dest / name).write_bytes((tokenizer_dir / name).read_bytes())
    return dest


def text(gen: np.random.Generator, words: int) -> str:
    return " ".join(gen.choice(WORDS, size=words).tolist())


def main(argv: list[str]) -> dict[str, Any]:
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"--device {args.device}: CUDA is not available here")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    gen = np.random.default_rng(args.seed)
    config = vecpool.LLMRerankerConfig.qwen3(instruction="Given a query, find passages about it")
    report: dict[str, Any] = {
        **record.header("bench_prefix.py", argv, device=args.device, commit=args.commit),
        "vecpool": getattr(vecpool, "__version__", "unknown"),
        "shape": args.shape,
        "dtype": str(dtype).removeprefix("torch."),
        "documents": args.documents,
    }
    with tempfile.TemporaryDirectory() as tmp:
        started = time.perf_counter()
        folder = write_folder(SHAPES[args.shape], Path(tmp), str(device), dtype, args.tokenizer)
        report["folder_seconds"] = round(time.perf_counter() - started, 2)
        options: dict[str, Any] = dict(
            device=str(device),
            dtype=dtype,
            llm_reranker=config,
            compile=args.compile,
            cuda_graphs=args.cuda_graphs,
            max_model_len=2048,
        )
        engines = {
            "plain": vecpool.Engine(folder, **options),
            "cached": vecpool.Engine(folder, enable_prefix_caching=True, **options),
        }
        # In bfloat16, both are compared with float32 (the same weights, eager, no cache): the
        # cache's error beside the dtype's own.
        reference = (
            vecpool.Engine(folder, device=str(device), dtype=torch.float32, llm_reranker=config)
            if dtype != torch.float32
            else None
        )
        error_to_fp32 = {name: 0.0 for name in engines}
        words = max(1, args.query_tokens)  # a word of WORDS is one token of the tokenizer

        def call() -> tuple[str, list[str]]:
            docs = [text(gen, int(n)) for n in gen.integers(10, 40, size=args.documents)]
            return text(gen, words), docs

        warm_query, warm_docs = call()
        for engine in engines.values():  # the first call pays one-time costs
            engine.score(warm_query, warm_docs)
        # As `vecpool serve` does once started: the collector's full passes skip start-up's
        # objects (else a pass over the compiled models' lands in some round and not another).
        gc.collect()
        gc.freeze()
        report["varlen_attention"] = engines["cached"].model_runner.use_varlen
        query_tokens = len(engines["plain"].tokenize(config.format(warm_query, "")))
        report["prompt_tokens_before_document"] = query_tokens
        seconds: dict[str, list[float]] = {name: [] for name in engines}
        score_diff, logit_diff = 0.0, 0.0
        stats_before = engines["cached"].core.prefix_cache_stats
        for round_ in range(args.rounds):
            query, docs = call()
            scores, logits = {}, {}
            for name, engine in engines.items():
                started = time.perf_counter()
                scores[name] = engine.score(query, docs)
                seconds[name].append(time.perf_counter() - started)
                logits[name] = engine.score(query, docs, use_activation=False)
            if reference is not None:
                exact = reference.score(query, docs, use_activation=False)
                for name in engines:
                    error = float(np.abs(logits[name] - exact).max())
                    error_to_fp32[name] = max(error_to_fp32[name], error)
            score_diff = max(score_diff, float(np.abs(scores["plain"] - scores["cached"]).max()))
            logit_diff = max(logit_diff, float(np.abs(logits["plain"] - logits["cached"]).max()))
            print(
                f"round {round_}: plain {seconds['plain'][-1]:.3f} s, "
                f"cached {seconds['cached'][-1]:.3f} s",
                flush=True,
            )
        hit, queried = (
            a - b
            for a, b in zip(engines["cached"].core.prefix_cache_stats, stats_before, strict=True)
        )
    medians = {name: statistics.median(values) for name, values in seconds.items()}
    report.update(
        rounds_seconds=seconds,
        median_seconds=medians,
        speedup=medians["plain"] / medians["cached"],
        max_score_diff=score_diff,
        max_logodds_diff=logit_diff,
        max_logodds_error_to_float32=error_to_fp32 if reference is not None else None,
        prefix_cache_hit_tokens=hit,
        prefix_cache_queried_tokens=queried,
    )
    graphs = engines["cached"].model_runner.graphs
    if graphs is not None:  # the first call of a new shape records its graph (a one-time cost)
        report["cached_graphs"] = {
            "recorded": len(graphs.graphs),
            "prefix_steps": sum(k.prefix is not None for k in graphs.graphs),
            "replays": graphs.replays,
        }
    shown = ("median_seconds", "speedup", "max_score_diff", "max_logodds_error_to_float32")
    print(json.dumps({k: report[k] for k in shown}))
    record.write(args.output, report)
    failures = []
    if hit <= 0:
        failures.append("the prefix cache served no token")
    if dtype == torch.float32 and score_diff > 1e-4:
        failures.append(f"scores differ by {score_diff:.2e} > 1e-4 in float32")
    if failures:
        raise SystemExit("FAILED: " + "; ".join(failures))
    return report


if __name__ == "__main__":
    main(sys.argv[1:])
