"""The keep-alive race: connections reset when a server's idle timeout equals its clients'.

    python benchmarks/lab/keepalive_race.py --timeout-keep-alive 5     # uvicorn's default: resets
    python benchmarks/lab/keepalive_race.py                            # vecpool's default (75 s)
    python benchmarks/lab/keepalive_race.py --timeouts 5 75 --output keepalive_race_2core.json

`--clients` httpx clients (one connection each, httpx's idle expiry: 5 s) send a request
together, then pause about 5 s, again and again. The server arms its idle timer when it sends a
response; a client arms its own when it has read the response, which, in a burst of hundreds,
is milliseconds later. A connection the client still takes for fresh is then closed by the
server just as the client sends on it, and the server's kernel answers that request with a
reset (httpx's `ReadError`). A server timeout well above the clients' leaves them no such
moment: the client always retires an idle connection first.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from collections import Counter
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks import record
from benchmarks.serving import ServerProcess

PAUSES = (4.95, 4.98, 4.99, 5.0, 4.995, 4.97, 4.985)


async def pauses(url: str, clients: int) -> Counter[str]:
    import httpx

    outcomes: Counter[str] = Counter()
    https = [httpx.AsyncClient(base_url=url, timeout=60) for _ in range(clients)]

    async def one(http: httpx.AsyncClient) -> None:
        try:
            response = await http.post("/v1/embeddings", json={"input": "hello world"})
            outcomes[str(response.status_code)] += 1
        except httpx.TransportError as exc:
            outcomes[type(exc).__name__] += 1

    try:
        await asyncio.gather(*(one(http) for http in https))
        for pause in PAUSES:
            await asyncio.sleep(pause)
            await asyncio.gather(*(one(http) for http in https))
    finally:
        await asyncio.gather(*(http.aclose() for http in https))
    return outcomes


def run(args: argparse.Namespace, timeout: float | None) -> dict[str, int]:
    """One round: a server (its keep-alive timeout `timeout`, else its default) and the
    clients' bursts; each outcome counted (status codes, transport error types)."""
    import tempfile

    import vecpool

    server_args = argparse.Namespace(**vars(args))
    if timeout is not None:
        server_args.server_args += f" --timeout-keep-alive {timeout:g}"
    model = args.model_dir or vecpool.api.default_model_path()
    with tempfile.TemporaryDirectory() as tmp:
        server = ServerProcess(model, server_args, Path(tmp) / "server.log")
        try:
            server.wait_ready()
            outcomes = asyncio.run(pauses(server.url, args.clients))
        finally:
            server.stop()
    print(timeout, json.dumps(dict(outcomes)), flush=True)
    return dict(outcomes)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model-dir", type=Path, help="default: the packaged model")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--clients", type=int, default=256)
    parser.add_argument("--timeout-keep-alive", type=float, help="the server's (default: its own)")
    parser.add_argument(
        "--timeouts", type=float, nargs="+", help="several servers' timeouts, one after another"
    )
    parser.add_argument("--rounds", type=int, default=1, help="rounds of each timeout")
    parser.add_argument("--server-args", default="", help="more `vecpool serve` options")
    parser.add_argument("--output", type=Path, help="write the report here as JSON")
    record.add_args(parser)
    args = parser.parse_args(argv)
    args.dtype = None
    report: dict[str, Any] = {
        **record.header(
            "lab/keepalive_race.py",
            sys.argv[1:] if argv is None else argv,
            device=args.device,
            commit=args.commit,
        ),
        "requests_per_round": args.clients * (len(PAUSES) + 1),
        "timeouts": {},
    }
    timeouts = args.timeouts or [args.timeout_keep_alive]
    for timeout in timeouts:
        rounds = [run(args, timeout) for _ in range(args.rounds)]
        resets = [sum(v for k, v in r.items() if not k.isdigit()) for r in rounds]
        report["timeouts"][str(timeout if timeout is not None else "default")] = {
            "rounds": rounds,
            "connection_errors": record.rounds(resets),
        }
        record.write(args.output, report)
    report["load_average_at_end"] = list(os.getloadavg())
    record.write(args.output, report)
    return report


if __name__ == "__main__":
    main(sys.argv[1:])
