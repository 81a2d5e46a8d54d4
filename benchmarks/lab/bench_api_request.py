"""What one single-query request costs an API process, the HTTP server aside: the app of an
API-server process (`create_api_app`: its middleware, routing, body parsing, validation,
tokenizing, the hop to the engine, rendering and metrics) driven through its ASGI interface by
`--clients` concurrent callers, with an engine client that answers every call at once with
zero vectors of `--dim` values.

    PYTHONPATH=. python benchmarks/lab/bench_api_request.py [--clients 64] [--n 4096]

On the GPU host an API process spent 1.1-1.3 ms of CPU per single-query request at 64 and 256
clients, five times what the engine process spent (`bench_online.py`'s CPU by process,
`online_qwen3-0.6b_float_h200.json`). This times that work in one process, without sockets
(uvicorn's HTTP parsing and writing are not in it) and without the engine, so that a change to
the API side is measured on its own. Per round: the event loop thread's CPU time per request
(`time.thread_time`; the input thread pool, used only for bodies over 16 KiB, is not in it)
and requests per second. The bodies are `bench_gpu.py`'s queries workload (4,096 queries of
8-64 tokens) as OpenAI embeddings calls of one text each, answered as JSON floats (the OpenAI
API's default) or base64. The figure is the median of `--rounds` rounds, each kept.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from tokenizers import Tokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks import record, workloads
from vecpool.api import default_model_path
from vecpool.calls import EngineInfo, PoolingOutput, PromptRequest
from vecpool.calls.outputs import RunTimes
from vecpool.server.app import create_api_app
from vecpool.server.config import ServerConfig

NAME = "bench"


class AnsweringClient:
    """An engine client (and the served-models client over it) that answers every call at
    once, after one pass of the event loop, with the same zero vector for each input."""

    max_queued = 1 << 30
    num_queued = 0
    expected_wait = 0.0
    is_running = True
    health_problem = None
    retry_after = None

    def __init__(self, dim: int):
        self.vector = np.zeros(dim, dtype=np.float32)
        self.groups = [self]
        self.calls = 0

    async def start(self) -> None:
        return None

    async def close(self) -> None:
        return None

    async def run(
        self, requests: Sequence[PromptRequest], times: RunTimes | None = None
    ) -> list[PoolingOutput]:
        await asyncio.sleep(0)  # the reply arrives on a later pass, as the engine's does
        self.calls += 1
        return [PoolingOutput(r.index, self.vector, None, r.prompt.num_tokens) for r in requests]


async def call(app: Any, body: bytes) -> int:
    """One POST /v1/embeddings through the app's ASGI interface; its status."""
    scope = {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/v1/embeddings",
        "raw_path": b"/v1/embeddings",
        "root_path": "",
        "query_string": b"",
        "headers": [
            (b"host", b"localhost"),
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
        ],
        "client": ("127.0.0.1", 50000),
        "server": ("127.0.0.1", 8000),
        "state": {},
    }
    sent_body = False
    done = asyncio.Event()
    status = 0

    async def receive() -> dict[str, Any]:
        nonlocal sent_body
        if not sent_body:
            sent_body = True
            return {"type": "http.request", "body": body, "more_body": False}
        await done.wait()  # the next message of an HTTP/1.1 cycle is the disconnect
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        nonlocal status
        if message["type"] == "http.response.start":
            status = message["status"]
        elif not message.get("more_body"):
            done.set()

    await app(scope, receive, send)
    return status


async def round_of(app: Any, bodies: list[bytes], clients: int) -> tuple[float, float]:
    """Every body sent once by `clients` callers in turn; (wall seconds, thread CPU seconds)."""
    feed = iter(bodies)
    statuses: list[int] = []

    async def caller() -> None:
        for body in feed:
            statuses.append(await call(app, body))

    wall, cpu = time.perf_counter(), time.thread_time()
    await asyncio.gather(*(caller() for _ in range(clients)))
    wall, cpu = time.perf_counter() - wall, time.thread_time() - cpu
    if statuses != [200] * len(bodies):
        raise RuntimeError(f"statuses other than 200: {sorted(set(statuses))}")
    return wall, cpu


async def run(args: argparse.Namespace, info: EngineInfo) -> list[tuple[float, float]]:
    client = AnsweringClient(args.dim)
    app = create_api_app(info, ServerConfig(model_names=(NAME,)), client)  # type: ignore[arg-type]
    tokenizer = Tokenizer.from_file(str(args.model_dir / "tokenizer.json"))
    lengths = workloads.workload_lengths("queries", args.n)
    texts, _ = workloads.make_inputs(tokenizer, lengths)
    bodies = [
        json.dumps({"input": text, "model": NAME, "encoding_format": args.encoding_format}).encode()
        for text in texts
    ]
    out: dict[str, list[tuple[float, float]]] = {path: [] for path in args.paths}
    fast = app.fast_app
    async with app.router.lifespan_context(app):
        for path in args.paths:  # warm
            app.fast_app = fast if path == "fast" else None
            await round_of(app, bodies[: args.clients * 4], args.clients)
        gc.collect()
        gc.freeze()  # as an API process does once started (`launcher.run_api_process`)
        for _ in range(args.rounds):
            for path in args.paths:  # interleaved, round by round
                app.fast_app = fast if path == "fast" else None
                wall, cpu = await round_of(app, bodies, args.clients)
                out[path].append((wall, cpu))
                print(
                    f"{path:8s} {args.n / wall:8.0f} requests/s, "
                    f"{cpu / args.n * 1e6:6.1f} µs of the loop's CPU per request",
                    flush=True,
                )
    return out


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-dir", type=Path, default=None, help="default: packaged MiniLM")
    parser.add_argument("--clients", type=int, default=64, help="callers at once")
    parser.add_argument("--n", type=int, default=4096, help="requests per round")
    parser.add_argument("--dim", type=int, default=1024, help="values per answered vector")
    parser.add_argument("--encoding-format", choices=("float", "base64"), default="float")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument(
        "--paths",
        nargs="+",
        choices=("fast", "fastapi"),
        default=["fast", "fastapi"],
        help="the app's fast path for work routes (`app.App`), FastAPI's whole stack, or both "
        "(rounds interleaved)",
    )
    parser.add_argument("--output", type=Path)
    record.add_args(parser)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    import vecpool

    args = parse_args(argv)
    args.model_dir = args.model_dir or default_model_path()
    # The app needs the model's description (tokenizer, limits, tasks), not its weights'
    # work: a CPU engine is built once for its `EngineInfo`.
    info = vecpool.Engine(args.model_dir, device="cpu").info()
    report = record.header(
        "lab/bench_api_request.py",
        sys.argv[1:] if argv is None else argv,
        device="cpu",
        commit=args.commit,
    )
    measured = asyncio.run(run(args, info))
    report.update(
        clients=args.clients,
        requests_per_round=args.n,
        dim=args.dim,
        encoding_format=args.encoding_format,
        paths={
            path: {
                "loop_cpu_us_per_request": record.rounds([c / args.n * 1e6 for _, c in rounds]),
                "requests_per_s": record.rounds([args.n / w for w, _ in rounds]),
            }
            for path, rounds in measured.items()
        },
    )
    if len(args.paths) == 2:  # each round's CPU through FastAPI over the fast path's
        cpu = {path: [c for _, c in rounds] for path, rounds in measured.items()}
        report["cpu_ratio_fastapi_to_fast"] = record.rounds(
            [slow / quick for quick, slow in zip(cpu["fast"], cpu["fastapi"], strict=True)]
        )
        print(
            f"FastAPI's path over the fast one: {report['cpu_ratio_fastapi_to_fast']['median']:.2f}x CPU"
        )
    record.write(args.output, report)
    return report


if __name__ == "__main__":
    main()
