"""The server and the clients of the online benchmarks: `vecpool serve` in its own process
group, closed-loop HTTP clients (httpx, or a minimal HTTP/1.1 client), and the CPU and engine
counters read around a round."""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

STARTUP_SECONDS = 600
_REFUSALS = 5  # non-200 bodies a round keeps, to say why the server refused


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


class AdmissionWatch:
    """Polls the server's /metrics on a thread while it runs (`with`): the engine's expected
    wait and measured speed as admission saw them, to show why calls were refused."""

    NAMES = ("vecpool_engine_expected_wait_seconds", "vecpool_engine_measured_tokens_per_second")

    def __init__(self, url: str, interval: float = 0.05):
        self.url, self.interval = url, interval
        self.samples: list[tuple[float, float, float]] = []  # (seconds in, wait, speed)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def __enter__(self) -> AdmissionWatch:
        self._start = time.perf_counter()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _poll(self) -> None:
        import httpx
        from prometheus_client.parser import text_string_to_metric_families

        with httpx.Client(timeout=5) as http:
            while not self._stop.wait(self.interval):
                try:
                    text = http.get(f"{self.url}/metrics").text
                except httpx.HTTPError:  # a scrape that timed out: the next one may not
                    continue
                values = {}
                for family in text_string_to_metric_families(text):
                    for sample in family.samples:
                        if sample.name in self.NAMES:
                            values[sample.name] = sample.value
                if len(values) == len(self.NAMES):
                    wait, speed = (values[n] for n in self.NAMES)
                    self.samples.append((time.perf_counter() - self._start, wait, speed))

    def summary(self) -> dict[str, Any]:
        """The largest wait and the speeds around it; every sample whose wait exceeded 1 s
        (the first 40)."""
        if not self.samples:
            return {"samples": 0}
        worst = max(self.samples, key=lambda x: x[1])
        speeds = [x[2] for x in self.samples if x[2] > 0]
        return {
            "samples": len(self.samples),
            "max_wait_s": worst[1],
            "speed_at_max_wait": worst[2],
            "min_speed": min(speeds) if speeds else 0.0,
            "max_speed": max(speeds) if speeds else 0.0,
            "over_1s": [list(x) for x in self.samples if x[1] > 1.0][:40],
        }


class ServerProcess:
    """`python -m vecpool serve` in its own process group, until `stop()`; `env`: its
    environment (default: this process's)."""

    def __init__(
        self, model: Path, args: argparse.Namespace, log: Path, env: dict[str, str] | None = None
    ):
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
                cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, env=env
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
    # CPU seconds the client processes used in the round (every thread, user and system),
    # and how many processes: when each is near one core's worth, the clients set the pace
    client_cpu_seconds: float = 0.0
    client_processes: int = 1
    latencies: list[float] = field(default_factory=list)  # seconds, answered requests
    # Per answered request, as the server's headers tell it (seconds): tokenizing in the API
    # process, and the call's round trip to the engine process (from the API process sending
    # it to its answer read there: the hops, the wait for the engine loop to take it, its
    # steps); what is left of the latency is the HTTP and the API process's other work.
    server_times: list[tuple[float, float]] = field(default_factory=list)
    tokens: int = 0
    connection_errors: Counter[str] = field(default_factory=Counter)
    statuses: Counter[int] = field(default_factory=Counter)
    refusals: list[str] = field(default_factory=list)  # the first few non-200 bodies
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
            "latency_split_ms": self.latency_split(),
            "client_cpu_s_per_request": self.client_cpu_seconds / max(len(self.latencies), 1),
            # the client processes' mean CPU use in the round: 1.0 is each one's core saturated
            "client_cpu_busy": self.client_cpu_seconds
            / max(self.seconds * self.client_processes, 1e-12),
            "connection_errors": dict(self.connection_errors),
            "connection_error_count": sum(self.connection_errors.values()),
            "statuses": {str(k): v for k, v in sorted(self.statuses.items())},
            "refusals": self.refusals,
        }

    def refused(self, status: int, body: bytes) -> None:
        """A non-200 answer: counted, and its body kept while fewer than `_REFUSALS` are."""
        self.statuses[status] += 1
        if len(self.refusals) < _REFUSALS:
            self.refusals.append(f"{status} {body[:300].decode(errors='replace')}")

    def latency_split(self) -> dict[str, dict[str, float]] | None:
        """Mean and median milliseconds of a request's latency by where it went: `tokenize`
        (in the API process), `engine` (the round trip from the API process to the engine
        process and back: the hops, the wait to be taken into a step, the steps), `rest`
        (everything else: the client, HTTP, the API process's other work, and waiting for
        them). The means add up to the mean latency. None without the server's times."""
        if not self.server_times or len(self.server_times) != len(self.latencies):
            return None
        total = np.array(self.latencies) * 1000
        tokenize, engine = (np.array(x) * 1000 for x in zip(*self.server_times, strict=True))
        parts = {"total": total, "tokenize": tokenize, "engine": engine}
        parts["rest"] = total - tokenize - engine
        return {
            name: {"mean": float(v.mean()), "p50": float(np.median(v))} for name, v in parts.items()
        }


def server_times(headers: Any) -> tuple[float, float] | None:
    """(tokenizing, the round trip to the engine) in seconds from a response's timing
    headers (a mapping of lower-case names to strings); None when they are not there."""
    try:
        return float(headers["x-tokenization-time"]) / 1000, (
            float(headers["x-queue-time"]) + float(headers["x-inference-time"])
        ) / 1000
    except (KeyError, ValueError):
        return None


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
            if response.status_code != 200:
                result.refused(response.status_code, response.content)
                continue
            result.statuses[200] += 1
            result.latencies.append(time.perf_counter() - start)
            times = server_times(response.headers)
            if times is not None:
                result.server_times.append(times)
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
                status, headers, body = await conn.post(workload.path, payloads[i])
            except (OSError, asyncio.IncompleteReadError, ValueError) as exc:
                result.connection_errors[type(exc).__name__] += 1
                if conn is not None:
                    conn.close()
                conn = None
                continue
            if status != 200:
                result.refused(status, body)
                if headers.get("connection", "").lower() == "close":
                    conn.close()  # the server closes it: the next request on it would fail
                    conn = None
                continue
            result.statuses[200] += 1
            result.latencies.append(time.perf_counter() - start)
            times = server_times(headers)
            if times is not None:
                result.server_times.append(times)
            parsed = json.loads(body)
            result.tokens += int(
                parsed["usage"].get("prompt_tokens", parsed["usage"]["total_tokens"])
            )
            if i < sample:
                result.answers[i] = parsed
        if conn is not None:
            conn.close()

    if raw:
        start, cpu = time.perf_counter(), time.process_time()
        deadline = start + max_seconds
        await asyncio.gather(*(raw_client() for _ in range(clients)))
        result.seconds = time.perf_counter() - start
        result.client_cpu_seconds = time.process_time() - cpu
        return result
    # One client, one connection: the clients of a server are separate programs (and a pool
    # of many connections in one httpx client costs its process far more per request). Built
    # before the clock starts: making one costs milliseconds of CPU (its SSL context).
    https = [httpx.AsyncClient(base_url=url, timeout=300.0) for _ in range(clients)]
    try:
        start, cpu = time.perf_counter(), time.process_time()
        deadline = start + max_seconds
        await asyncio.gather(*(client(http) for http in https))
        result.seconds = time.perf_counter() - start
        result.client_cpu_seconds = time.process_time() - cpu
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

    async def post(self, path: str, body: bytes) -> tuple[int, dict[str, str], bytes]:
        """(status, headers by lower-case name, body)."""
        head = (
            f"POST {path} HTTP/1.1\r\nhost: {self.host}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\n\r\n"
        )
        self.writer.write(head.encode() + body)
        status_line = await self.reader.readuntil(b"\r\n")
        if not status_line.startswith(b"HTTP/1.1 "):
            raise ValueError(f"not an HTTP/1.1 response: {status_line[:40]!r}")
        status = int(status_line.split(b" ", 2)[1])
        head = await self.reader.readuntil(b"\r\n\r\n")
        headers = {}
        for line in head.decode("latin-1").split("\r\n"):
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
        if "content-length" not in headers:
            raise ValueError("a response without content-length")
        return status, headers, await self.reader.readexactly(int(headers["content-length"]))

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
    total = Round(clients, seconds=max(r.seconds for r in rounds), client_processes=n)
    for r in rounds:
        total.client_cpu_seconds += r.client_cpu_seconds
        total.latencies += r.latencies
        total.server_times += r.server_times
        total.tokens += r.tokens
        total.connection_errors.update(r.connection_errors)
        total.statuses.update(r.statuses)
        total.refusals += r.refusals[: _REFUSALS - len(total.refusals)]
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


def tree_cpu_seconds(pid: int) -> dict[str, float]:
    """CPU seconds (user and system) that process `pid` and its descendants have used so far,
    read from /proc (0 where there is none): in all (`total`), and by the server's process
    names (`api`: its API processes, `engine`: its engine processes, `other`: the rest)."""
    tick = os.sysconf("SC_CLK_TCK")
    parents: dict[int, int] = {}
    times: dict[int, float] = {}
    names: dict[int, str] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            head, _, tail = stat.read_text().rpartition(")")
            fields = tail.split()
        except OSError:
            continue  # gone meanwhile
        if not fields:
            continue
        child = int(stat.parent.name)
        parents[child] = int(fields[1])
        times[child] = (int(fields[11]) + int(fields[12])) / tick  # utime + stime
        names[child] = head.partition("(")[2]
    tree, grew = {pid}, True
    while grew:
        grew = False
        for child, parent in parents.items():
            if parent in tree and child not in tree:
                tree.add(child)
                grew = True
    out = {"total": 0.0, "api": 0.0, "engine": 0.0, "other": 0.0}
    for child in tree:
        name = names.get(child, "")
        role = next((r for r in ("api", "engine") if name.startswith(f"vecpool-{r}")), "other")
        out[role] += times.get(child, 0.0)
        out["total"] += times.get(child, 0.0)
    return out


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
