"""`vecpool bench`: the throughput of one model on this machine, on synthetic texts.

Texts have log-uniformly spread lengths (many short, some long), as real traffic does; each
timed run embeds all of them in one call after a warm-up, and the report gives the median.
With `--quantization`, it also gives the least and the median cosine between the quantized
vectors and those of the same model unquantized (a second engine, built after the timing).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from typing import TYPE_CHECKING

import numpy as np

from vecpool.api.args import DEFAULT_MODEL_NAME, EngineArgs
from vecpool.calls import EmbedOptions
from vecpool.errors import ConfigError

if TYPE_CHECKING:  # the command line loads torch only to run a model
    from vecpool.api import Engine

WORDS = (
    "the a of to and in is that for on with as by at from this it be are was an or which "
    "model vector pooling engine batch token attention layer score query document search "
    "retrieval dense sparse embedding language neural network training inference latency "
    "throughput memory device kernel sequence length budget request server client cache"
).split()


def make_texts(n: int, seed: int = 0, min_words: int = 4, max_words: int = 180) -> list[str]:
    """`n` texts whose word counts spread log-uniformly over [min_words, max_words]."""
    gen = np.random.default_rng(seed)
    counts = np.exp(gen.uniform(np.log(min_words), np.log(max_words), size=n)).astype(int)
    return [" ".join(gen.choice(WORDS, size=c)) for c in counts]


def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the `bench` options to `parser`."""
    EngineArgs.add_cli_args(parser)
    parser.add_argument("-n", "--num-inputs", type=int, default=2000, metavar="N")
    parser.add_argument("--repeats", type=int, default=3, metavar="R", help="timed runs")
    parser.add_argument("--max-words", type=int, default=180, metavar="W")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")


def run_bench(args: argparse.Namespace, engine: Engine | None = None) -> int:
    """Embed synthetic texts `repeats` times; print inputs/s and tokens/s (medians)."""
    if args.num_inputs < 1 or args.repeats < 1 or args.max_words < 4:
        raise ConfigError("--num-inputs and --repeats must be positive, --max-words at least 4")
    if engine is None:
        from vecpool.api import Engine

        engine = Engine.from_args(EngineArgs.from_cli_args(args))
    texts = make_texts(args.num_inputs, max_words=args.max_words)
    num_tokens = sum(min(len(engine.tokenize(t, prompt="")), engine.max_model_len) for t in texts)
    import torch

    sync = torch.cuda.synchronize if engine.device.type == "cuda" else (lambda: None)
    options = EmbedOptions(truncate_prompt_tokens=-1).keywords()  # inputs cut to the limit
    engine.embed(texts[:256], **options, show_progress=False)  # warm-up
    seconds = []
    for _ in range(args.repeats):
        sync()
        start = time.perf_counter()
        vectors = engine.embed(texts, **options, show_progress=False)
        sync()
        seconds.append(time.perf_counter() - start)
    median = statistics.median(seconds)
    report = {
        "model": args.model or f"{DEFAULT_MODEL_NAME} (the default model)",
        "device": str(engine.device),
        "dtype": str(engine.dtype).removeprefix("torch."),
        "num_inputs": len(texts),
        "num_tokens": num_tokens,
        "seconds": seconds,
        "inputs_per_s": len(texts) / median,
        "tokens_per_s": num_tokens / median,
    }
    quantization = getattr(args, "quantization", None)
    cosine = None if quantization is None else cosine_to_unquantized(args, texts, vectors)
    if cosine is not None:
        report["quantization"] = quantization
        report["cosine_to_float32"] = cosine
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(
            f"{report['model']} on {report['device']} ({report['dtype']}): "
            f"{len(texts):,} inputs, {num_tokens:,} tokens\n"
            f"  median of {len(seconds)}: {median:.3f} s = {report['inputs_per_s']:,.0f} inputs/s, "
            f"{report['tokens_per_s']:,.0f} tokens/s  (runs: "
            + ", ".join(f"{s:.3f}" for s in seconds)
            + " s)"
        )
        if cosine is not None:
            print(
                f"  {quantization}: cosine to the unquantized model's vectors "
                f"min {cosine['min']:.5f}, median {cosine['median']:.5f} ({len(texts):,} inputs)"
            )
    return 0


def cosine_to_unquantized(
    args: argparse.Namespace, texts: list[str], vectors: np.ndarray
) -> dict[str, float]:
    """The least and the median cosine between `vectors` (the quantized engine's, one per
    text) and the same texts through an engine of the same options without quantization."""
    from vecpool.api import Engine

    reference_args = dataclasses.replace(EngineArgs.from_cli_args(args), quantization=None)
    reference = Engine.from_args(reference_args).embed(
        texts, **EmbedOptions(truncate_prompt_tokens=-1).keywords(), show_progress=False
    )
    a, b = np.asarray(vectors, dtype=np.float64), np.asarray(reference, dtype=np.float64)
    cos = (a * b).sum(-1) / (np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1))
    return {"min": float(cos.min()), "median": float(np.median(cos))}
