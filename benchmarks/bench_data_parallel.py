"""Data parallel: passages-workload tokens/s through `vecpool serve` and through the engines of
`vecpool embed`, at each `--data-parallel-size` of `--sizes`, and each size's ratio to the first.

    python benchmarks/bench_data_parallel.py --synthetic qwen3-0.6b --device cuda --sizes 1 2 \
        --output dp_qwen3-0.6b.json

The workload is bench_gpu's passages (lognormal around 180 tokens, clipped to [32, 512], texts
of whole-word vocabulary entries, fixed seed), `--passages` of them:
- **serve**: `vecpool serve --data-parallel-size N` in its own process tree (`--server-args`
  adds options), `--clients` closed-loop clients each posting 32 passages per `/v1/embeddings`
  request (base64), spread over `--client-processes`; after a warm-up round, `--repeats` rounds
  of the whole workload, the median kept; with it, the prompt tokens each engine answered
  (`vecpool_engine_answered_tokens_total`), which shows the balance.
- **embed**: the engines `vecpool embed --data-parallel-size N` runs (`vecpool.cli.parallel`:
  one in this process at 1, N processes above), fed chunks of `--chunk-size` passages; the
  model's load and a warm-up pass excluded, `--repeats` timed passes, the median kept.
`--modes` runs one of the two (each loads the model once per size).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks import record
from benchmarks.bench_online import BATCH_INPUTS
from benchmarks.serving import (
    AdmissionWatch,
    ServerProcess,
    Workload,
    add_server_and_client_args,
    load,
)
from benchmarks.workloads import SHAPES, make_inputs, workload_lengths, write_folder

MODES = ("serve", "embed")


def passages(args: argparse.Namespace) -> list[str]:
    import tokenizers

    tokenizer = tokenizers.Tokenizer.from_file(str(args.tokenizer / "tokenizer.json"))
    tokenizer.no_truncation()
    tokenizer.no_padding()
    texts, _ = make_inputs(tokenizer, workload_lengths("passages", args.passages, seed=1), seed=1)
    return texts


def answered_tokens(url: str) -> dict[str, float]:
    """Prompt tokens each engine process answered, by rank, from the server's /metrics."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics").text):
        for sample in family.samples:
            if sample.name == "vecpool_engine_answered_tokens_total":
                out[sample.labels["engine"]] = sample.value
    return dict(sorted(out.items()))


def run_serve(model: Path, texts: list[str], size: int, args: argparse.Namespace, log: Path) -> Any:
    """Tokens/s of the passages through a server of `size` engine processes."""
    workload = Workload(
        "/v1/embeddings",
        [
            {
                "input": texts[i : i + BATCH_INPUTS],
                "encoding_format": "base64",
                "truncate_prompt_tokens": -1,
            }
            for i in range(0, len(texts), BATCH_INPUTS)
        ],
        0,
    )
    server_args = argparse.Namespace(**vars(args))
    server_args.server_args = f"--data-parallel-size {size} {args.server_args}"
    server = ServerProcess(model, server_args, log)
    pool = None
    if args.client_processes > 1:
        pool = ProcessPoolExecutor(args.client_processes, mp_context=mp.get_context("spawn"))
    try:
        server.wait_ready()
        n = len(workload.bodies)
        load(server.url, workload, args.clients, limit=n, args=args, pool=pool)  # warm-up
        before = answered_tokens(server.url)
        rounds = []
        for _ in range(args.repeats):
            with AdmissionWatch(server.url) as watch:
                r = load(server.url, workload, args.clients, limit=n, args=args, pool=pool)
            rounds.append({**r.summary(), "admission": watch.summary()})
        after = answered_tokens(server.url)
    finally:
        if pool is not None:
            pool.shutdown()
        server.stop()
    # The median round by tokens/s (of an even count the lower middle one), and every round.
    row = dict(record.median_round(rounds, "tokens_per_s"))
    row["rounds_tokens_per_s"] = [x["tokens_per_s"] for x in rounds]
    row["rounds"] = rounds
    row["connection_error_count"] = sum(x["connection_error_count"] for x in rounds)
    row["answered_tokens_by_engine"] = {k: v - before.get(k, 0.0) for k, v in after.items()}
    row["server_command"] = [record.portable_arg(c) for c in server.command]
    return row


def run_embed(model: Path, texts: list[str], size: int, args: argparse.Namespace) -> Any:
    """Tokens/s of the passages through `vecpool embed`'s engines, `size` of them."""
    from vecpool.api import Engine, EngineArgs
    from vecpool.calls import EmbedOptions
    from vecpool.cli.corpus import Chunk
    from vecpool.cli.parallel import EmbedJob, LocalEmbedder, ProcessEmbedder

    engine_args = EngineArgs(model, device=args.device, dtype=args.dtype)
    job = EmbedJob(EmbedOptions(truncate_prompt_tokens=-1), "line")  # `vecpool embed --truncate`
    chunks = [
        Chunk(texts[i : i + args.chunk_size], list(range(i, i + args.chunk_size)))
        for i in range(0, len(texts), args.chunk_size)
    ]
    start = time.perf_counter()
    embedder: LocalEmbedder | ProcessEmbedder
    if size == 1:
        embedder = LocalEmbedder(Engine.from_args(engine_args), job)
    else:
        embedder = ProcessEmbedder(engine_args, job, size)
    load_seconds = time.perf_counter() - start
    try:
        passes = []
        for i in range(args.repeats + 1):  # the first: warm-up (compilation, allocator)
            start = time.perf_counter()
            tokens = rows = 0
            for _, vectors, n in embedder.run(iter(chunks)):
                tokens += n
                rows += vectors.shape[0]
            if args.device.startswith("cuda"):
                torch.cuda.synchronize()  # the engines of other processes synchronize their own
            seconds = time.perf_counter() - start
            assert rows == len(texts), (rows, len(texts))
            if i > 0:
                passes.append(
                    {"seconds": seconds, "tokens": tokens, "tokens_per_s": tokens / seconds}
                )
    finally:
        embedder.close()
    row = dict(record.median_round(passes, "tokens_per_s"))
    row["rounds_tokens_per_s"] = [x["tokens_per_s"] for x in passes]
    row["load_seconds"] = load_seconds
    return row


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--model-dir", type=Path, help="a model folder (default: the packaged one)")
    which.add_argument("--synthetic", choices=sorted(SHAPES), help="a random-weight shape")
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 2], help="data-parallel sizes")
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    parser.add_argument("--passages", type=int, default=16384)
    parser.add_argument("--clients", type=int, default=64, help="serve: concurrent clients")
    parser.add_argument("--chunk-size", type=int, default=1024, help="embed: passages per chunk")
    parser.add_argument(
        "--repeats", type=int, default=record.MIN_ROUNDS, help="timed rounds per size and mode"
    )
    parser.add_argument("--max-seconds", type=float, default=300.0, help="serve: per round")
    add_server_and_client_args(parser, client_default="raw")
    parser.add_argument("--output", type=Path, help="write the report here as JSON")
    record.add_args(parser)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if args.tokenizer is None:
        import vecpool

        args.tokenizer = vecpool.api.default_model_path()
    report: dict[str, Any] = {
        **record.header(
            "bench_data_parallel.py",
            sys.argv[1:] if argv is None else argv,
            device=args.device,
            commit=args.commit,
        ),
        "args": {
            k: record.portable_arg(str(v)) if isinstance(v, Path) else v
            for k, v in vars(args).items()
        },
    }
    texts = passages(args)
    with tempfile.TemporaryDirectory(prefix="vecpool-dp-") as tmp_name:
        tmp = Path(tmp_name)
        model = args.model_dir or args.tokenizer  # the packaged default model's folder
        if args.synthetic is not None:
            model = write_folder(SHAPES[args.synthetic], tmp / "model", args.tokenizer, args.device)
        try:
            for mode in args.modes:
                rows = report[mode] = {}
                for size in args.sizes:
                    if mode == "serve":
                        rows[str(size)] = run_serve(
                            model, texts, size, args, tmp / f"serve-{size}.log"
                        )
                    else:
                        rows[str(size)] = run_embed(model, texts, size, args)
                    print(
                        f"{mode:5s} data-parallel-size {size}: "
                        f"{rows[str(size)]['tokens_per_s']:12.0f} tokens/s",
                        flush=True,
                    )
                first = rows[str(args.sizes[0])]["tokens_per_s"]
                report.setdefault("ratio", {})[mode] = {
                    str(size): rows[str(size)]["tokens_per_s"] / first for size in args.sizes
                }
                print(f"{mode:5s} ratio to size {args.sizes[0]}: {report['ratio'][mode]}")
        finally:
            record.write(args.output, report)
    return report


if __name__ == "__main__":
    main()
