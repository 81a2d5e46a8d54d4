"""Online serving: many concurrent clients against `vecpool serve`, next to the offline `Engine`
on the same inputs, in one run.

    python benchmarks/bench_online.py --model-dir DIR --device cuda --output online.json
    python benchmarks/bench_online.py --synthetic qwen3-0.6b --device cuda --output online.json

Scenarios (`--scenarios`, fixed seeds, texts as `bench_gpu.py` makes them: whole-word
vocabulary entries of the MiniLM tokenizer, so a text of L tokens is L tokens):
- **embed**: `/v1/embeddings` with one query each (the queries workload, U[8, 64] tokens),
  base64 output, at each `--clients` count; against offline `Engine.embed` of the same queries.
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
For each client count, after a warm-up round, `--repeats` rounds each sit between two offline
runs of the same work, and a round's ratio is to the mean of those two (on a shared machine the
load moves both alike); a row keeps the median round (and every round's numbers): requests/s,
tokens/s, latency p50 / p90 / p99 / max, each connection error type and non-200 status counted,
the ratio to offline tokens/s, and the largest difference of sampled answers from offline.

CPU cost: each round also reads the CPU seconds (user and system) of the server's whole
process tree (supervisor, API processes, engine) from /proc, and the offline runs around it
their own (`time.process_time`, every thread of this process); a row gives the server's CPU per
request and per item (an input; a call for rerank) next to offline's per item, and their ratio
(`cpu_efficiency`: 100% when serving costs what offline costs). `queue_drain_ms` is how long
the server takes to answer as many requests as there are clients (what a request waits behind
in a closed loop), and `p99_over_drain` the 99th-percentile latency over it (near 1 when
requests are answered first come, first served).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import multiprocessing as mp
import os
import platform
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.bench_gpu import (
    SHAPES,
    TOKENIZER_FILES,
    git_commit,
    make_inputs,
    workload_lengths,
    write_folder,
)

SCENARIOS = ("embed", "rerank", "batched")
RERANK_DOCS = 20
BATCH_INPUTS = 32
STARTUP_SECONDS = 600


# ---- inputs ---------------------------------------------------------------------------------


def doc_lengths(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(16, 48, size=n, endpoint=True)


@dataclass
class Workload:
    """The bodies of one scenario's requests, and what offline runs on."""

    path: str
    bodies: list[dict[str, Any]]
    tokens: int  # prompt tokens of all bodies (as the server counts them)


# ---- the server -----------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ServerProcess:
    """`python -m vecpool serve` in its own process group, until `stop()`."""

    def __init__(self, model: Path, args: argparse.Namespace, log: Path):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "vecpool", "serve", str(model), "--port", str(self.port)]
        cmd += ["--device", args.device, "--log-level", "warning", "--max-queued", "65536"]
        if args.dtype:
            cmd += ["--dtype", args.dtype]
        cmd += args.server_args.split()
        self.log = log
        with log.open("wb") as out:
            self.process = subprocess.Popen(
                cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )
        self.command = cmd

    def wait_ready(self) -> None:
        import httpx

        deadline = time.monotonic() + STARTUP_SECONDS
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"the server exited:\n{self.log.read_text()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"the server did not start:\n{self.log.read_text()}")

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()


# ---- clients --------------------------------------------------------------------------------


@dataclass
class Round:
    """What one round of requests measured."""

    clients: int
    seconds: float = 0.0
    latencies: list[float] = field(default_factory=list)  # seconds, answered requests
    tokens: int = 0
    connection_errors: Counter[str] = field(default_factory=Counter)
    statuses: Counter[int] = field(default_factory=Counter)
    answers: dict[int, dict[str, Any]] = field(default_factory=dict)  # a sample, by body index

    def summary(self) -> dict[str, Any]:
        lat = np.array(self.latencies) * 1000 if self.latencies else np.zeros(1)
        return {
            "clients": self.clients,
            "requests": len(self.latencies),
            "seconds": self.seconds,
            "requests_per_s": len(self.latencies) / self.seconds,
            "tokens_per_s": self.tokens / self.seconds,
            "latency_ms": {
                "p50": float(np.percentile(lat, 50)),
                "p90": float(np.percentile(lat, 90)),
                "p99": float(np.percentile(lat, 99)),
                "max": float(lat.max()),
            },
            "connection_errors": dict(self.connection_errors),
            "connection_error_count": sum(self.connection_errors.values()),
            "statuses": {str(k): v for k, v in sorted(self.statuses.items())},
        }


async def run_round(
    url: str,
    workload: Workload,
    clients: int,
    *,
    limit: int,
    max_seconds: float,
    sample: int = 0,
    raw: bool = False,
) -> Round:
    """`clients` closed-loop clients sending `workload`'s bodies in turn (at most `limit`
    requests, `max_seconds`), each on its own keep-alive connection (httpx, or `raw`: a
    minimal HTTP/1.1 client); keeps the first `sample` answers."""
    import httpx

    result = Round(clients)
    total = min(limit, len(workload.bodies))
    next_index = 0
    deadline = 0.0
    payloads = [json.dumps(b).encode() for b in workload.bodies]
    headers = {"content-type": "application/json"}

    async def client(http: httpx.AsyncClient) -> None:
        nonlocal next_index
        while next_index < total and time.perf_counter() < deadline:
            i = next_index
            next_index += 1
            start = time.perf_counter()
            try:
                response = await http.post(workload.path, content=payloads[i], headers=headers)
            except httpx.TransportError as exc:  # a connection reset, refused, timed out...
                result.connection_errors[type(exc).__name__] += 1
                continue
            result.statuses[response.status_code] += 1
            if response.status_code != 200:
                continue
            result.latencies.append(time.perf_counter() - start)
            body = response.json()
            result.tokens += int(body["usage"].get("prompt_tokens", body["usage"]["total_tokens"]))
            if i < sample:
                result.answers[i] = body

    async def raw_client() -> None:
        nonlocal next_index
        conn: RawConnection | None = None
        while next_index < total and time.perf_counter() < deadline:
            i = next_index
            next_index += 1
            start = time.perf_counter()
            try:
                if conn is None:
                    conn = await RawConnection.open(url)
                status, body = await conn.post(workload.path, payloads[i])
            except (OSError, asyncio.IncompleteReadError, ValueError) as exc:
                result.connection_errors[type(exc).__name__] += 1
                if conn is not None:
                    conn.close()
                conn = None
                continue
            result.statuses[status] += 1
            if status != 200:
                continue
            result.latencies.append(time.perf_counter() - start)
            parsed = json.loads(body)
            result.tokens += int(
                parsed["usage"].get("prompt_tokens", parsed["usage"]["total_tokens"])
            )
            if i < sample:
                result.answers[i] = parsed
        if conn is not None:
            conn.close()

    if raw:
        start = time.perf_counter()
        deadline = start + max_seconds
        await asyncio.gather(*(raw_client() for _ in range(clients)))
        result.seconds = time.perf_counter() - start
        return result
    # One client, one connection: the clients of a server are separate programs (and a pool
    # of many connections in one httpx client costs its process far more per request). Built
    # before the clock starts: making one costs milliseconds of CPU (its SSL context).
    https = [httpx.AsyncClient(base_url=url, timeout=300.0) for _ in range(clients)]
    try:
        start = time.perf_counter()
        deadline = start + max_seconds
        await asyncio.gather(*(client(http) for http in https))
        result.seconds = time.perf_counter() - start
    finally:
        await asyncio.gather(*(http.aclose() for http in https))
    return result


class RawConnection:
    """A minimal HTTP/1.1 keep-alive client connection (asyncio streams): a fraction of a
    full client's CPU per request, so that on a small machine the load generator takes less
    from the server it measures. Any broken exchange raises (OSError, IncompleteReadError)."""

    def __init__(self, host: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self.host = host
        self.reader = reader
        self.writer = writer

    @classmethod
    async def open(cls, url: str) -> RawConnection:
        hostport = url.removeprefix("http://")
        host, _, port = hostport.partition(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        sock = writer.get_extra_info("socket")
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return cls(hostport, reader, writer)

    async def post(self, path: str, body: bytes) -> tuple[int, bytes]:
        head = (
            f"POST {path} HTTP/1.1\r\nhost: {self.host}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\n\r\n"
        )
        self.writer.write(head.encode() + body)
        status_line = await self.reader.readuntil(b"\r\n")
        if not status_line.startswith(b"HTTP/1.1 "):
            raise ValueError(f"not an HTTP/1.1 response: {status_line[:40]!r}")
        status = int(status_line.split(b" ", 2)[1])
        headers = await self.reader.readuntil(b"\r\n\r\n")
        length = None
        for line in headers.split(b"\r\n"):
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value)
        if length is None:
            raise ValueError("a response without content-length")
        return status, await self.reader.readexactly(length)

    def close(self) -> None:
        self.writer.close()


def _round_in_process(
    url: str, workload: Workload, clients: int, limit: int, max_seconds: float, raw: bool
) -> Round:
    return asyncio.run(
        run_round(url, workload, clients, limit=limit, max_seconds=max_seconds, raw=raw)
    )


def load(
    url: str,
    workload: Workload,
    clients: int,
    *,
    limit: int,
    args: argparse.Namespace,
    pool: ProcessPoolExecutor | None,
) -> Round:
    """One round of `clients` clients, spread over the processes of `pool` (a client process
    of Python saturates its core long before a GPU server does) or run here."""
    raw = args.client == "raw"
    if pool is None:
        return asyncio.run(
            run_round(url, workload, clients, limit=limit, max_seconds=args.max_seconds, raw=raw)
        )
    n = args.client_processes
    futures = [
        pool.submit(
            _round_in_process,
            url,
            Workload(workload.path, workload.bodies[w::n], 0),
            clients // n + (w < clients % n),
            limit // n + (w < limit % n),
            args.max_seconds,
            raw,
        )
        for w in range(n)
    ]
    rounds = [f.result() for f in futures]
    total = Round(clients, seconds=max(r.seconds for r in rounds))
    for r in rounds:
        total.latencies += r.latencies
        total.tokens += r.tokens
        total.connection_errors.update(r.connection_errors)
        total.statuses.update(r.statuses)
    return total


def decode_base64(data: str) -> np.ndarray:
    return np.frombuffer(base64.b64decode(data), dtype="<f4")


# ---- offline, and the rounds next to it -----------------------------------------------------


def engine_metrics(url: str) -> dict[str, float]:
    """The engine's counters from the server's /metrics: steps, inputs and tokens they ran,
    seconds spent in them."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    wanted = {
        "vecpool_engine_steps_total": "steps",
        "vecpool_batch_tokens_sum": "tokens",
        "vecpool_engine_step_seconds_sum": "step_seconds",
    }
    out = dict.fromkeys([*wanted.values(), "inputs"], 0.0)
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics").text):
        for sample in family.samples:
            if sample.name in wanted:
                out[wanted[sample.name]] += sample.value
            elif sample.name == "vecpool_engine_requests_total" and sample.labels.get(
                "outcome"
            ) in ("finished", "failed"):
                out["inputs"] += sample.value
    return out


def tree_cpu_seconds(pid: int) -> float:
    """CPU seconds (user and system) that process `pid` and its descendants have used so far,
    read from /proc (0 where there is none)."""
    tick = os.sysconf("SC_CLK_TCK")
    parents: dict[int, int] = {}
    times: dict[int, float] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # gone meanwhile
        child = int(stat.parent.name)
        parents[child] = int(fields[1])
        times[child] = (int(fields[11]) + int(fields[12])) / tick  # utime + stime
    tree, grew = {pid}, True
    while grew:
        grew = False
        for child, parent in parents.items():
            if parent in tree and child not in tree:
                tree.add(child)
                grew = True
    return sum(times.get(child, 0.0) for child in tree)


def timed(fn: Callable[[], Any], device: str) -> tuple[float, Any]:
    """Seconds of one call of `fn`, and its result."""
    seconds, _, out = timed_cpu(fn, device)
    return seconds, out


def timed_cpu(fn: Callable[[], Any], device: str) -> tuple[float, float, Any]:
    """Seconds of one call of `fn`, the CPU seconds this process (every thread) spent in it,
    and its result."""
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    start, cpu = time.perf_counter(), time.process_time()
    out = fn()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return time.perf_counter() - start, time.process_time() - cpu, out


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
    moves both alike), and the row keeps the median round's numbers."""
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
            row["server_cpu_s_per_request"] = (c1 - c0) / max(len(r.latencies), 1)
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
        rounds.sort(key=lambda x: x["ratio_to_offline"])
        row = dict(rounds[len(rounds) // 2])
        row["rounds"] = [
            {k: x[k] for k in ("tokens_per_s", "offline_tokens_per_s", "ratio_to_offline")}
            | {"p99_ms": x["latency_ms"]["p99"], "errors": x["connection_error_count"]}
            | {"inputs_per_step": x["engine"]["inputs_per_step"]}
            | {
                k: x[k]
                for k in (
                    "requests_per_s",
                    "server_cpu_s_per_request",
                    "server_cpu_s_per_item",
                    "offline_cpu_s_per_item",
                    "p99_over_drain",
                )
            }
            for x in rounds
        ]
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
    if "embed" in args.scenarios:
        prompts = engine.context.inputs.process(queries, vecpool.TextOptions())
        work = Workload(
            "/v1/embeddings",
            [{"input": q, "encoding_format": "base64"} for q in queries],
            sum(p.num_tokens for p in prompts),
        )
        out.append(
            Scenario(
                "embed",
                work,
                len(queries),
                lambda: engine.embed(queries, show_progress=False),
                lambda answers, vectors: max(
                    float(np.abs(decode_base64(a["data"][0]["embedding"]) - vectors[i]).max())
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
                    "encoding_format": "base64",
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
                    float(
                        np.abs(decode_base64(d["embedding"]) - vectors[i * BATCH_INPUTS + j]).max()
                    )
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
        f"({row['server_cpu_s_per_item'] * 1000:.2f} ms/item), offline "
        f"{row['offline_cpu_s_per_item'] * 1000:.2f} ms/item ({row['cpu_efficiency']:.0%} "
        f"efficient); p99 {row['p99_over_drain']:.2f}x the queue's drain "
        f"({row['queue_drain_ms']:.1f} ms)",
        flush=True,
    )


# ---- main -----------------------------------------------------------------------------------


def add_server_and_client_args(parser: argparse.ArgumentParser, *, client_default: str) -> None:
    """The options of a benchmark that starts `vecpool serve` and drives it with clients."""
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default=None, help="default: the engine's for the device")
    parser.add_argument("--server-args", default="", help="more `vecpool serve` options")
    parser.add_argument(
        "--client",
        choices=("httpx", "raw"),
        default=client_default,
        help="httpx (what real clients use) or a minimal HTTP/1.1 client (less CPU)",
    )
    parser.add_argument(
        "--client-processes",
        type=int,
        default=max(1, min(8, (os.cpu_count() or 1) // 4)),
        help="processes the clients are spread over (default: one per 4 CPU cores, 1 to 8)",
    )
    parser.add_argument("--tokenizer", type=Path, help="default: the packaged MiniLM's folder")


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
    parser.add_argument("--n", type=int, default=4096, help="queries, and requests per round")
    parser.add_argument("--rerank-calls", type=int, default=1024, help="distinct rerank calls")
    parser.add_argument("--max-seconds", type=float, default=120.0, help="per round")
    parser.add_argument("--repeats", type=int, default=3, help="rounds per client count")
    add_server_and_client_args(parser, client_default="httpx")
    parser.add_argument("--output", type=Path, help="write the report here as JSON")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    import tokenizers

    args = parse_args(argv)
    if args.tokenizer is None:
        import vecpool

        args.tokenizer = vecpool.api.default_model_path()
    tokenizer = tokenizers.Tokenizer.from_file(str(args.tokenizer / "tokenizer.json"))
    tokenizer.no_truncation()
    tokenizer.no_padding()
    import transformers

    report: dict[str, Any] = {
        "command": "python benchmarks/bench_online.py "
        + " ".join(sys.argv[1:] if argv is None else argv),
        "commit": git_commit(),
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "python": platform.python_version(),
        "transformers": transformers.__version__,
        # Folders by name only: the machine's paths say nothing to another reader.
        "args": {
            k: (str(v) if not v.is_absolute() else v.name) if isinstance(v, Path) else v
            for k, v in vars(args).items()
        },
        "machine": {
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "load_average_at_start": os.getloadavg(),
            "torch": torch.__version__,
            "device_name": torch.cuda.get_device_name()
            if args.device.startswith("cuda")
            else "cpu",
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
            report["machine"]["load_average_at_end"] = os.getloadavg()
            if args.output:
                args.output.write_text(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
