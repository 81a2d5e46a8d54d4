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
its own keep-alive connection. Every round is preceded by a warm-up round. The report has, per
round: requests/s, tokens/s, latency p50 / p90 / p99 / max, the count of each connection error
type and of each non-200 status, and the ratio to offline tokens/s; a sample of answers is
checked against the offline outputs. `--server-args` passes options to `vecpool serve` (e.g.
`--api-server-count 2 --batch-wait-ms 2`); the server runs as its own process tree, the clients
and the offline engine in this process, one after the other.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import gc
import json
import os
import platform
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.bench_gpu import (
    SHAPES,
    TOKENIZER_FILES,
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
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    timeout = httpx.Timeout(300.0)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=timeout) as http:
        start = time.perf_counter()
        deadline = start + max_seconds
        await asyncio.gather(*(client(http) for _ in range(clients)))
        result.seconds = time.perf_counter() - start
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


def measure(
    url: str, workload: Workload, clients: int, args: argparse.Namespace, sample: int = 0
) -> Round:
    warm = min(len(workload.bodies), max(2 * clients, 64))
    asyncio.run(run_round(url, workload, clients, limit=warm, max_seconds=args.max_seconds))
    return asyncio.run(
        run_round(url, workload, clients, limit=args.n, max_seconds=args.max_seconds, sample=sample)
    )


def decode_base64(data: str) -> np.ndarray:
    return np.frombuffer(base64.b64decode(data), dtype="<f4")


# ---- offline --------------------------------------------------------------------------------


def timed(fn: Any, repeats: int, device: str) -> tuple[float, Any]:
    """The median seconds of `repeats` timed calls after one warm-up, and the last result."""
    out = fn()
    times = []
    for _ in range(repeats):
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        start = time.perf_counter()
        out = fn()
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return float(np.median(times)), out


def free_engine(engine: Any) -> None:
    del engine
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# ---- scenarios ------------------------------------------------------------------------------


def bench_embed(
    model: Path, texts: list[str], args: argparse.Namespace, tmp: Path, report: dict[str, Any]
) -> None:
    """Single-query and batched embeddings against offline `embed` of the same texts."""
    import vecpool

    scenarios = [s for s in ("embed", "batched") if s in args.scenarios]
    if not scenarios:
        return
    queries = texts[: args.n]
    engine = vecpool.Engine(model, device=args.device, dtype=args.dtype)
    limit = engine.info().max_model_len
    offline: dict[str, tuple[float, np.ndarray, int]] = {}
    if "embed" in scenarios:
        seconds, vectors = timed(lambda: engine.embed(queries), args.repeats, args.device)
        prompts = engine.context.inputs.process(queries, vecpool.TextOptions())
        tokens = sum(p.num_tokens for p in prompts)
        offline["embed"] = (seconds, vectors, tokens)
    passages: list[str] = []
    if "batched" in scenarios:
        passages = report["_passages"][: args.n * 4]
        seconds, vectors = timed(
            lambda: engine.embed(passages, truncate_prompt_tokens=-1), args.repeats, args.device
        )
        tokens = int(np.minimum(report["_passage_lengths"][: len(passages)], limit).sum())
        offline["batched"] = (seconds, vectors, tokens)
    free_engine(engine)

    server = ServerProcess(model, args, tmp / "server-embed.log")
    report["server_command"] = server.command
    try:
        server.wait_ready()
        if "embed" in scenarios:
            seconds, vectors, tokens = offline["embed"]
            work = Workload(
                "/v1/embeddings",
                [{"input": q, "encoding_format": "base64"} for q in queries],
                tokens,
            )
            for clients in args.clients:
                r = measure(server.url, work, clients, args, sample=64)
                row = _row("embed", r, tokens / seconds, len(queries) / seconds)
                row["max_abs_diff_vs_offline"] = max(
                    float(np.abs(decode_base64(a["data"][0]["embedding"]) - vectors[i]).max())
                    for i, a in r.answers.items()
                )
                report["rows"].append(row)
                _print(row)
        if "batched" in scenarios:
            seconds, vectors, tokens = offline["batched"]
            bodies = [
                {
                    "input": passages[i : i + BATCH_INPUTS],
                    "encoding_format": "base64",
                    "truncate_prompt_tokens": -1,
                }
                for i in range(0, len(passages), BATCH_INPUTS)
            ]
            work = Workload("/v1/embeddings", bodies, tokens)
            r = measure(server.url, work, args.batched_clients, args)
            row = _row("batched", r, tokens / seconds, len(passages) / seconds)
            report["rows"].append(row)
            _print(row)
    finally:
        server.stop()


def bench_rerank(args: argparse.Namespace, tmp: Path, report: dict[str, Any]) -> None:
    """Single-query rerank (20 documents) against offline `rerank` of the same calls."""
    import tokenizers

    import vecpool

    folder = args.rerank_model_dir or write_cross_encoder(tmp / "cross-encoder", args)
    tokenizer = tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json"))
    tokenizer.no_truncation()
    num_calls = min(args.n, args.rerank_calls)
    q_texts, _ = make_inputs(tokenizer, workload_lengths("queries", num_calls, seed=3), seed=3)
    d_texts, _ = make_inputs(tokenizer, doc_lengths(num_calls * RERANK_DOCS, seed=4), seed=4)
    calls = [
        (q_texts[i], d_texts[i * RERANK_DOCS : (i + 1) * RERANK_DOCS]) for i in range(num_calls)
    ]
    engine = vecpool.Engine(folder, device=args.device, dtype=args.dtype)

    def offline() -> list[list[tuple[int, float]]]:
        # Every call prepared, then run together: the engine's own best for these calls.
        prepared = [engine.prepare_rerank(q, docs) for q, docs in calls]
        requests = [r for p in prepared for r in p.requests]

        def finish(outputs: list[Any]) -> list[list[tuple[int, float]]]:
            results, at = [], 0
            for p in prepared:
                results.append(p.finish(outputs[at : at + len(p.requests)]))
                at += len(p.requests)
            return results

        return engine.run(vecpool.PreparedCall(requests, finish))

    seconds, expected = timed(offline, args.repeats, args.device)
    tokens = sum(len(r.prompt.token_ids) for p in calls for r in engine.prepare_rerank(*p).requests)
    free_engine(engine)
    server = ServerProcess(folder, args, tmp / "server-rerank.log")
    try:
        server.wait_ready()
        work = Workload(
            "/rerank",
            [{"query": q, "documents": docs, "return_documents": False} for q, docs in calls],
            tokens,
        )
        for clients in args.rerank_clients:
            r = measure(server.url, work, clients, args, sample=32)
            row = _row("rerank", r, tokens / seconds, num_calls / seconds)
            row["max_abs_diff_vs_offline"] = max(
                abs(res["relevance_score"] - dict(expected[i])[res["index"]])
                for i, a in r.answers.items()
                for res in a["results"]
            )
            report["rows"].append(row)
            _print(row)
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


def _row(scenario: str, r: Round, offline_tokens_s: float, offline_requests_s: float) -> dict:
    row = {"scenario": scenario, **r.summary()}
    row["offline_tokens_per_s"] = offline_tokens_s
    row["offline_items_per_s"] = offline_requests_s
    row["ratio_to_offline"] = row["tokens_per_s"] / offline_tokens_s
    return row


def _print(row: dict[str, Any]) -> None:
    lat = row["latency_ms"]
    print(
        f"{row['scenario']:8s} clients={row['clients']:4d} {row['requests_per_s']:9.1f} req/s "
        f"{row['tokens_per_s']:10.0f} tok/s ({row['ratio_to_offline']:.0%} of offline) "
        f"p50 {lat['p50']:.1f} ms p99 {lat['p99']:.1f} ms "
        f"errors {row['connection_errors']} statuses {row['statuses']}",
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
    parser.add_argument("--n", type=int, default=4096, help="requests per round (at most)")
    parser.add_argument("--rerank-calls", type=int, default=1024, help="distinct rerank calls")
    parser.add_argument("--max-seconds", type=float, default=120.0, help="per round")
    parser.add_argument("--repeats", type=int, default=3, help="offline timings (median)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default=None, help="default: the engine's for the device")
    parser.add_argument("--server-args", default="", help="more `vecpool serve` options")
    parser.add_argument(
        "--client",
        choices=("httpx", "raw"),
        default="httpx",
        help="httpx (what real clients use) or a minimal HTTP/1.1 client (less CPU)",
    )
    parser.add_argument("--tokenizer", type=Path, help="default: the packaged MiniLM's folder")
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
    report: dict[str, Any] = {
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
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
    passage_lengths = workload_lengths("passages", args.n * 4, seed=1)
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
            bench_embed(model, queries, args, tmp, report)
            if "rerank" in args.scenarios:
                bench_rerank(args, tmp, report)
        finally:
            del report["_passages"], report["_passage_lengths"]
            report["machine"]["load_average_at_end"] = os.getloadavg()
            if args.output:
                args.output.write_text(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
