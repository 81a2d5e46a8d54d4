"""Online serving: many concurrent clients against `vecpool serve`, next to the offline `Engine`
on the same inputs, in one run.

    python benchmarks/bench_online.py --model-dir DIR --device cuda --output online.json
    python benchmarks/bench_online.py --synthetic qwen3-0.6b --device cuda --output online.json

Scenarios (`--scenarios`, fixed seeds, texts as `bench_gpu.py` makes them: whole-word
vocabulary entries of the MiniLM tokenizer, so a text of L tokens is L tokens):
- **embed**: `/v1/embeddings` with one query each (the queries workload, U[8, 64] tokens),
  base64 output (`--encoding-format float`: JSON numbers, what the OpenAI API answers by
  default), at each `--clients` count; against offline `Engine.embed` of the same queries.
- **rerank**: `/rerank` with one query and 20 short documents (U[16, 48] tokens) each, at
  `--rerank-clients`, on a cross-encoder (`--rerank-model-dir`, else a random-weight one of
  BERT-base shape); against offline `rerank` of the same calls run as one batch.
- **batched**: `/v1/embeddings` with 32 passages each (lognormal around 180 tokens, clipped to
  [32, 512]) from 32 clients; against offline `embed` of the same passages.

Each client sends its next request as soon as its last one is answered (a closed loop), over
its own keep-alive connection (`--client httpx`, what real clients use, or `raw`: a minimal
HTTP/1.1 client that leaves more of a small machine to the server). The server runs as its own
process tree (`--server-args` adds `vecpool serve` options, e.g. `--api-server-count 2
--batch-wait-ms 2`); the offline engine and the clients run in this process, never at once.
For each client count, after a warm-up round, `--repeats` rounds (at least 3) each sit between
two offline runs of the same work, and a round's ratio is to the mean of those two (on a shared
machine the load moves both alike); a row is the median round by that ratio (one real round, its
numbers consistent with each other), with each figure's median over the rounds (`median`) and
every round (`rounds`): requests/s, tokens/s, latency p50 / p90 / p99 / max, each connection
error type and non-200 status counted, the ratio to offline tokens/s, and the largest
difference of sampled answers from offline. The report's header is `record.py`'s.

CPU cost: each round also reads the CPU seconds (user and system) of the server's whole
process tree (supervisor, API processes, engine) from /proc, and the offline runs around it
their own (`time.process_time`, every thread of this process); a row gives the server's CPU per
request and per item (an input; a call for rerank) next to offline's per item, and their ratio
(`cpu_efficiency`: 100% when serving costs what offline costs). The client processes' own CPU
per request and how busy they were (`client_cpu_busy`, 100%: each client process used a whole
core, and the clients, not the server, set the pace). `queue_drain_ms` is how long
the server takes to answer as many requests as there are clients (what a request waits behind
in a closed loop), and `p99_over_drain` the 99th-percentile latency over it (near 1 when
requests are answered first come, first served).
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import sys
import tempfile
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks import record
from benchmarks.serving import (
    ServerProcess,
    Workload,
    add_server_and_client_args,
    decode_base64,
    engine_metrics,
    load,
    run_round,
    timed,
    timed_cpu,
    tree_cpu_seconds,
)
from benchmarks.workloads import (
    SHAPES,
    TOKENIZER_FILES,
    doc_lengths,
    make_inputs,
    workload_lengths,
    write_folder,
)

SCENARIOS = ("embed", "rerank", "batched")
RERANK_DOCS = 20
BATCH_INPUTS = 32


@dataclass
class Scenario:
    """One workload, run by clients against the server and offline by an engine in this
    process, on the same inputs."""

    name: str
    workload: Workload
    items: int  # inputs (embed, batched) or calls (rerank) of the whole workload
    offline: Callable[[], Any]  # the same work offline; its result checks the answers
    diff: Callable[[dict[int, dict[str, Any]], Any], float]  # sampled answers vs offline
    clients: list[int]


def run_scenario(
    scenario: Scenario, server: ServerProcess, args: argparse.Namespace, report: dict[str, Any]
) -> None:
    """For each client count, `--repeats` times: offline, a round of clients, offline again;
    each round's ratio is to the mean of the offline runs around it (a shared machine's load
    moves both alike); the row keeps the median round's numbers, each figure's median over
    the rounds, and every round."""
    url = server.url
    _, expected = timed(scenario.offline, args.device)  # warm-up, and the reference outputs
    w = scenario.workload
    # The answers checked against offline: a round of one client process keeps them.
    sample_round = asyncio.run(
        run_round(
            url, w, 8, limit=64, max_seconds=args.max_seconds, sample=64, raw=args.client == "raw"
        )
    )
    diff = scenario.diff(sample_round.answers, expected)
    pool = None
    if args.client_processes > 1:
        pool = ProcessPoolExecutor(args.client_processes, mp_context=mp.get_context("spawn"))
    try:
        _run_counts(scenario, server, args, report, pool, diff)
    finally:
        if pool is not None:
            pool.shutdown()


def _run_counts(
    scenario: Scenario,
    server: ServerProcess,
    args: argparse.Namespace,
    report: dict[str, Any],
    pool: ProcessPoolExecutor | None,
    diff: float,
) -> None:
    w, url = scenario.workload, server.url
    for clients in scenario.clients:
        warm = min(len(w.bodies), max(2 * clients, 64))
        load(url, w, clients, limit=warm, args=args, pool=pool)
        rounds = []
        for _ in range(args.repeats):
            before, cpu_before, _ = timed_cpu(scenario.offline, args.device)
            m0 = engine_metrics(url)
            c0 = tree_cpu_seconds(server.process.pid)
            r = load(url, w, clients, limit=args.n, args=args, pool=pool)
            c1 = tree_cpu_seconds(server.process.pid)
            m1 = engine_metrics(url)
            after, cpu_after, _ = timed_cpu(scenario.offline, args.device)
            offline_s = (before + after) / 2
            row = {"scenario": scenario.name, **r.summary()}
            row["offline_seconds"] = [before, after]
            row["offline_tokens_per_s"] = w.tokens / offline_s
            row["offline_items_per_s"] = scenario.items / offline_s
            row["ratio_to_offline"] = row["tokens_per_s"] / row["offline_tokens_per_s"]
            row["max_abs_diff_vs_offline"] = diff
            # CPU: the server's whole process tree per request, next to offline per item.
            # (An item: an input of embed and batched, a call of rerank; a batched request
            # carries several.)
            done = max(len(r.latencies), 1)
            row["server_cpu_s_per_request"] = (c1["total"] - c0["total"]) / done
            # ... and by process: the API processes', the engine processes', the supervisor's.
            row["server_cpu_s_per_request_by_process"] = {
                role: (c1[role] - c0[role]) / done for role in ("api", "engine", "other")
            }
            row["server_cpu_s_per_item"] = row["server_cpu_s_per_request"] / (
                scenario.items / len(w.bodies)
            )
            row["offline_cpu_s_per_item"] = (cpu_before + cpu_after) / 2 / scenario.items
            row["cpu_efficiency"] = row["offline_cpu_s_per_item"] / max(
                row["server_cpu_s_per_item"], 1e-12
            )
            # A closed loop of `clients`: a request waits behind the others, which the server
            # drains at its rate; p99 against that time says whether it serves in order.
            row["queue_drain_ms"] = clients / row["requests_per_s"] * 1000
            row["p99_over_drain"] = row["latency_ms"]["p99"] / row["queue_drain_ms"]
            steps = m1["steps"] - m0["steps"]
            row["engine"] = {
                "steps": steps,
                "inputs_per_step": (m1["inputs"] - m0["inputs"]) / max(steps, 1),
                "tokens_per_step": (m1["tokens"] - m0["tokens"]) / max(steps, 1),
                "step_ms": (m1["step_seconds"] - m0["step_seconds"]) / max(steps, 1) * 1000,
                "busy": (m1["step_seconds"] - m0["step_seconds"]) / r.seconds,
            }
            rounds.append(row)
        # The row is the median round by its ratio to offline (one real round, so that its
        # numbers agree with each other; of an even count the lower middle one), next to
        # each figure's median over the rounds and every round's numbers, in the order run.
        row = dict(record.median_round(rounds, "ratio_to_offline"))
        row["median_round_by"] = "ratio_to_offline"
        row["median"] = record.median_of_rounds(rounds)
        row["rounds"] = rounds
        row["connection_error_count"] = sum(x["connection_error_count"] for x in rounds)
        report["rows"].append(row)
        _print(row)


# ---- scenarios ------------------------------------------------------------------------------


def embed_scenarios(
    engine: Any, queries: list[str], args: argparse.Namespace, report: dict[str, Any]
) -> list[Scenario]:
    """Single-query embeddings and batched passages, against offline `embed`."""
    import vecpool

    out = []
    fmt = args.encoding_format

    def vector(value: Any) -> np.ndarray:  # one answer's vector, as asked for
        return decode_base64(value) if fmt == "base64" else np.asarray(value, dtype=np.float32)

    if "embed" in args.scenarios:
        prompts = engine.context.inputs.process(queries, vecpool.TextOptions())
        work = Workload(
            "/v1/embeddings",
            [{"input": q, "encoding_format": fmt} for q in queries],
            sum(p.num_tokens for p in prompts),
        )
        out.append(
            Scenario(
                "embed",
                work,
                len(queries),
                lambda: engine.embed(queries, show_progress=False),
                lambda answers, vectors: max(
                    float(np.abs(vector(a["data"][0]["embedding"]) - vectors[i]).max())
                    for i, a in answers.items()
                ),
                args.clients,
            )
        )
    if "batched" in args.scenarios:
        passages = report["_passages"]
        limit = engine.info().max_model_len
        work = Workload(
            "/v1/embeddings",
            [
                {
                    "input": passages[i : i + BATCH_INPUTS],
                    "encoding_format": fmt,
                    "truncate_prompt_tokens": -1,
                }
                for i in range(0, len(passages), BATCH_INPUTS)
            ],
            int(np.minimum(report["_passage_lengths"], limit).sum()),
        )
        out.append(
            Scenario(
                "batched",
                work,
                len(passages),
                lambda: engine.embed(passages, truncate_prompt_tokens=-1, show_progress=False),
                lambda answers, vectors: max(
                    float(np.abs(vector(d["embedding"]) - vectors[i * BATCH_INPUTS + j]).max())
                    for i, a in answers.items()
                    for j, d in enumerate(a["data"])
                ),
                [args.batched_clients],
            )
        )
    return out


def rerank_scenario(engine: Any, args: argparse.Namespace) -> Scenario:
    """Single-query rerank (a query and 20 documents) against offline `rerank` of the same
    calls, prepared and run as one batch (the engine's own best for them)."""
    import tokenizers

    import vecpool

    tokenizer = tokenizers.Tokenizer.from_file(str(engine.info().tokenizer_file))
    tokenizer.no_truncation()
    tokenizer.no_padding()
    num_calls = args.rerank_calls
    q_texts, _ = make_inputs(tokenizer, workload_lengths("queries", num_calls, seed=3), seed=3)
    d_texts, _ = make_inputs(tokenizer, doc_lengths(num_calls * RERANK_DOCS, seed=4), seed=4)
    calls = [
        (q_texts[i], d_texts[i * RERANK_DOCS : (i + 1) * RERANK_DOCS]) for i in range(num_calls)
    ]

    def offline() -> list[list[tuple[int, float]]]:
        prepared = [engine.prepare_rerank(q, docs) for q, docs in calls]
        requests = [r for p in prepared for r in p.requests]

        def finish(outputs: list[Any]) -> list[list[tuple[int, float]]]:
            results, at = [], 0
            for p in prepared:
                results.append(p.finish(outputs[at : at + len(p.requests)]))
                at += len(p.requests)
            return results

        return engine.run(vecpool.PreparedCall(requests, finish), show_progress=False)

    tokens = sum(r.prompt.num_tokens for c in calls for r in engine.prepare_rerank(*c).requests)
    work = Workload(
        "/rerank",
        [{"query": q, "documents": docs, "return_documents": False} for q, docs in calls],
        tokens,
    )
    return Scenario(
        "rerank",
        work,
        num_calls,
        offline,
        lambda answers, expected: max(
            abs(res["relevance_score"] - dict(expected[i])[res["index"]])
            for i, a in answers.items()
            for res in a["results"]
        ),
        args.rerank_clients,
    )


def serve_and_run(
    model: Path,
    make: Callable[[Any], list[Scenario]],
    args: argparse.Namespace,
    log: Path,
    report: dict[str, Any],
) -> None:
    """Load `model` offline here and in a server, and run `make(engine)`'s scenarios."""
    import vecpool

    scenarios = make(vecpool.Engine(model, device=args.device, dtype=args.dtype))
    if not scenarios:
        return
    server = ServerProcess(model, args, log)
    report.setdefault("server_commands", []).append(
        [Path(c).name if os.path.isabs(c) else c for c in server.command]  # no machine paths
    )
    try:
        server.wait_ready()
        for scenario in scenarios:
            run_scenario(scenario, server, args, report)
    finally:
        server.stop()


def write_cross_encoder(dest: Path, args: argparse.Namespace) -> Path:
    """A BertForSequenceClassification folder (one label) of BERT-base shape, random weights,
    with the MiniLM tokenizer."""
    import transformers

    torch.manual_seed(0)
    config = transformers.BertConfig(**SHAPES["bert-base"].config, num_labels=1)
    config.architectures = ["BertForSequenceClassification"]
    transformers.BertForSequenceClassification(config).save_pretrained(str(dest))
    for name in TOKENIZER_FILES:
        (dest / name).write_bytes((args.tokenizer / name).read_bytes())
    return dest


def _print(row: dict[str, Any]) -> None:
    lat = row["latency_ms"]
    by = row["server_cpu_s_per_request_by_process"]
    print(
        f"{row['scenario']:8s} clients={row['clients']:4d} {row['requests_per_s']:9.1f} req/s "
        f"{row['tokens_per_s']:10.0f} tok/s ({row['ratio_to_offline']:.0%} of offline) "
        f"p50 {lat['p50']:.1f} ms p99 {lat['p99']:.1f} ms "
        f"errors {row['connection_errors']} statuses {row['statuses']} | "
        f"{row['engine']['inputs_per_step']:.1f} inputs/step, step {row['engine']['step_ms']:.1f} "
        f"ms, engine busy {row['engine']['busy']:.0%}",
        flush=True,
    )
    print(
        f"{'':8s} CPU: server {row['server_cpu_s_per_request'] * 1000:.2f} ms/request "
        f"(API {by['api'] * 1000:.2f}, engine {by['engine'] * 1000:.2f}) "
        f"({row['server_cpu_s_per_item'] * 1000:.2f} ms/item), offline "
        f"{row['offline_cpu_s_per_item'] * 1000:.2f} ms/item ({row['cpu_efficiency']:.0%} "
        f"efficient); p99 {row['p99_over_drain']:.2f}x the queue's drain "
        f"({row['queue_drain_ms']:.1f} ms); clients {row['client_cpu_s_per_request'] * 1000:.2f} "
        f"ms/request, their processes {row['client_cpu_busy']:.0%} busy",
        flush=True,
    )
    split = row.get("latency_split_ms")
    if split:
        print(
            f"{'':8s} latency, mean ms: {split['total']['mean']:.2f} = tokenizing "
            f"{split['tokenize']['mean']:.2f} + the engine's round trip "
            f"{split['engine']['mean']:.2f} + the rest {split['rest']['mean']:.2f} (HTTP, the "
            "API process)",
            flush=True,
        )


# ---- main -----------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    which = parser.add_mutually_exclusive_group()
    which.add_argument(
        "--model-dir", type=Path, help="the embedding model folder (default: the packaged one)"
    )
    which.add_argument("--synthetic", choices=sorted(SHAPES), help="a random-weight shape")
    parser.add_argument("--rerank-model-dir", type=Path, help="default: random BERT-base CE")
    parser.add_argument("--scenarios", nargs="+", default=list(SCENARIOS), choices=SCENARIOS)
    parser.add_argument("--clients", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--rerank-clients", type=int, nargs="+", default=[64])
    parser.add_argument("--batched-clients", type=int, default=32)
    parser.add_argument("--batched-inputs", type=int, default=8192, help="passages in all")
    parser.add_argument(
        "--n",
        type=int,
        default=16384,
        help="queries, and requests per round (rounds of 4,096 lasted under a second on a GPU, "
        "and their ratios to offline spread from 0.44 to 0.85 in one run)",
    )
    parser.add_argument("--rerank-calls", type=int, default=1024, help="distinct rerank calls")
    parser.add_argument(
        "--encoding-format",
        choices=("base64", "float"),
        default="base64",
        help="how embed and batched answers carry their vectors (float: JSON numbers)",
    )
    parser.add_argument("--max-seconds", type=float, default=120.0, help="per round")
    parser.add_argument(
        "--repeats",
        type=int,
        default=record.MIN_ROUNDS,
        help=f"rounds per client count (at least {record.MIN_ROUNDS})",
    )
    add_server_and_client_args(parser, client_default="httpx")
    parser.add_argument("--output", type=Path, help="write the report here as JSON")
    record.add_args(parser)
    args = parser.parse_args(argv)
    if args.repeats < record.MIN_ROUNDS:
        parser.error(f"--repeats: at least {record.MIN_ROUNDS} rounds, to report their median")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    import tokenizers

    args = parse_args(argv)
    if args.tokenizer is None:
        import vecpool

        args.tokenizer = vecpool.api.default_model_path()
    tokenizer = tokenizers.Tokenizer.from_file(str(args.tokenizer / "tokenizer.json"))
    tokenizer.no_truncation()
    tokenizer.no_padding()
    report: dict[str, Any] = {
        **record.header(
            "bench_online.py",
            sys.argv[1:] if argv is None else argv,
            device=args.device,
            commit=args.commit,
        ),
        # Folders by name only: the machine's paths say nothing to another reader.
        "args": {
            k: (str(v) if not v.is_absolute() else v.name) if isinstance(v, Path) else v
            for k, v in vars(args).items()
        },
        "rows": [],
    }
    queries, _ = make_inputs(tokenizer, workload_lengths("queries", args.n))
    passage_lengths = workload_lengths("passages", args.batched_inputs, seed=1)
    report["_passages"], _ = make_inputs(tokenizer, passage_lengths, seed=1)
    report["_passage_lengths"] = passage_lengths
    with tempfile.TemporaryDirectory(prefix="vecpool-online-") as tmp_name:
        tmp = Path(tmp_name)
        model = args.model_dir
        if args.synthetic is not None:
            shape = SHAPES[args.synthetic]
            model = write_folder(shape, tmp / "model", args.tokenizer, args.device)
        elif model is None:  # the packaged default model
            model = args.tokenizer
        try:
            serve_and_run(
                model,
                lambda engine: embed_scenarios(engine, queries, args, report),
                args,
                tmp / "server-embed.log",
                report,
            )
            if "rerank" in args.scenarios:
                folder = args.rerank_model_dir or write_cross_encoder(tmp / "cross-encoder", args)
                serve_and_run(
                    folder,
                    lambda engine: [rerank_scenario(engine, args)],
                    args,
                    tmp / "server-rerank.log",
                    report,
                )
        finally:
            del report["_passages"], report["_passage_lengths"]
            report["load_average_at_end"] = list(os.getloadavg())
            record.write(args.output, report)
    return report


if __name__ == "__main__":
    main()
