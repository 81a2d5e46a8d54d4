"""Single queries served on a small CPU: `vecpool serve` under the CPU's own instruction set and
capped at AVX2, at a few and at many closed-loop clients, rounds interleaved.

    python benchmarks/bench_online_cpu.py --output benchmarks/results/online_cpu_minilm_2core.json

The model is the packaged all-MiniLM-L6-v2, float32 (`--model-dir` for another folder,
`--synthetic` for a random-weight shape). The workload is `bench_online.py`'s **embed**: one
query of U[8, 64] tokens per `/v1/embeddings` request, base64 output, fixed seed; each client
sends its next request as soon as its last one is answered, over its own keep-alive connection
(`--client raw`, a minimal HTTP/1.1 client, by default: on two cores the load generator runs
beside the server). The figures are issue 53's (item 5): requests/s, latency p50 / p99, the
queue's drain time (the seconds the server takes to answer as many requests as there are
clients: what a request waits behind in a closed loop) and p99 over it, and the server's CPU
per request by process (API, engine; user and system time from /proc, far less moved by other
work on the machine than wall time), next to an offline engine's CPU per input on the same
queries.

Each instruction set (`--isa`, default both) has a server and an offline engine of its own,
started with `bench_cpu.py`'s caps in their environment for `avx2` (`ONEDNN_MAX_CPU_ISA=AVX2`,
`MKL_ENABLE_INSTRUCTIONS=AVX2`, `ATEN_CPU_CAPABILITY=avx2`, read when torch loads, and FBGEMM's)
and those unset for `native`; the report keeps each one's caps, torch's instruction set and
the offline engine's logged CPU choice. A round runs, for each instruction set in an
order that rotates from round to round, the offline engine once and then each `--clients`
count (a short warm-up, then `--n` requests); every round is kept with its caps, and the
summary gives each figure's median over the rounds and the issue's targets: at the largest
client count p99 at most 1.5x the drain time, and requests/s no lower than at the smallest.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import IO, Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks import record
from benchmarks.bench_cpu import CAP_NAMES, CAPS, _Choices
from benchmarks.serving import (
    ServerProcess,
    Workload,
    engine_metrics,
    load,
    tree_cpu_seconds,
)
from benchmarks.workloads import SHAPES, make_inputs, workload_lengths, write_folder

# Issue 53's targets at the largest client count: p99 over the drain time at most this, and
# requests/s at least the smallest count's.
P99_OVER_DRAIN_TARGET = 1.5
WARM_UP_REQUESTS = 128  # per client count and round, before the measured requests


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--model-dir", type=Path, help="default: the packaged MiniLM")
    which.add_argument("--synthetic", choices=sorted(SHAPES), help="a random-weight shape")
    parser.add_argument("--clients", type=int, nargs="+", default=[8, 64])
    parser.add_argument("--n", type=int, default=1024, help="queries, and requests per round")
    parser.add_argument("--rounds", type=int, default=record.MIN_ROUNDS)
    parser.add_argument("--isa", nargs="+", default=list(CAPS), choices=list(CAPS))
    parser.add_argument("--server-args", default="", help="more `vecpool serve` options")
    parser.add_argument("--client", choices=("raw", "httpx"), default="raw")
    parser.add_argument("--max-seconds", type=float, default=300.0, help="per round")
    parser.add_argument("--output", type=Path, help="write the report here as JSON")
    # Internal: an offline engine that embeds the queries on each line "run" of its stdin.
    parser.add_argument("--offline-child", type=Path, help=argparse.SUPPRESS)
    record.add_args(parser)
    args = parser.parse_args(argv)
    if args.rounds < record.MIN_ROUNDS:
        parser.error(f"--rounds: at least {record.MIN_ROUNDS}, to report their median")
    # What `serving.load` and `ServerProcess` read: one client process on a small machine.
    args.device, args.dtype, args.client_processes = "cpu", None, 1
    return args


def queries(model: Path, n: int) -> list[str]:
    """The workload's `n` queries (U[8, 64] tokens, fixed seed) with `model`'s tokenizer."""
    import tokenizers

    tokenizer = tokenizers.Tokenizer.from_file(str(model / "tokenizer.json"))
    tokenizer.no_truncation()
    tokenizer.no_padding()
    return make_inputs(tokenizer, workload_lengths("queries", n))[0]


def caps_environment(isa: str) -> dict[str, str]:
    """This process's environment with `isa`'s caps (and no other)."""
    env = {k: v for k, v in os.environ.items() if k not in CAP_NAMES}
    env.update(CAPS[isa])
    return env


# ---- the offline engine, one process per instruction set ------------------------------------


def offline_child(model: Path, n: int) -> None:
    """Load an engine, say so on stdout (with torch's instruction set and threads), then for
    each line of stdin embed the queries once and print the seconds and CPU seconds."""
    import torch

    import vecpool

    texts = queries(model, n)
    # What the engine logs of its CPU choice. The server's engine makes its own, the same one
    # where the machine was quiet enough for the measurement to be cached.
    choices = _Choices()
    choice_logger = logging.getLogger("vecpool.runner.cpu_choice")
    choice_logger.addHandler(choices)
    choice_logger.setLevel(logging.INFO)
    engine = vecpool.Engine(model, device="cpu")
    engine.embed(texts[:256], show_progress=False)  # warm-up
    ready = {
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "threads": torch.get_num_threads(),
        "cpu_choice": choices.lines,
    }
    print(json.dumps(ready), flush=True)
    for _ in sys.stdin:
        start, cpu = time.perf_counter(), time.process_time()
        engine.embed(texts, show_progress=False)
        seconds = time.perf_counter() - start
        print(json.dumps({"seconds": seconds, "cpu_seconds": time.process_time() - cpu}))
        sys.stdout.flush()


class Offline:
    """An offline engine in a child process under `env`'s instruction set."""

    def __init__(self, model: Path, n: int, env: dict[str, str]):
        command = [sys.executable, str(Path(__file__).resolve()), "--offline-child", str(model)]
        self.process = subprocess.Popen(
            [*command, "--n", str(n)], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE
        )
        self.info = self._read()

    def _read(self) -> dict[str, Any]:
        stdout: IO[bytes] | None = self.process.stdout
        line = stdout.readline() if stdout is not None else b""
        if not line:
            raise RuntimeError(f"the offline engine exited ({self.process.wait()})")
        return dict(json.loads(line))

    def run(self) -> dict[str, Any]:
        """Embed the queries once: seconds, CPU seconds."""
        assert self.process.stdin is not None
        self.process.stdin.write(b"run\n")
        self.process.stdin.flush()
        return self._read()

    def stop(self) -> None:
        if self.process.stdin is not None:
            self.process.stdin.close()
        self.process.wait(timeout=60)


@contextmanager
def started(model: Path, args: argparse.Namespace, isa: str, tmp: Path) -> Iterator[Any]:
    """`isa`'s server (ready) and offline engine, stopped on exit."""
    env = caps_environment(isa)
    server = ServerProcess(model, args, tmp / f"server-{isa}.log", env=env)
    offline = None
    try:
        server.wait_ready()
        offline = Offline(model, args.n, env)
        yield server, offline
    finally:
        server.stop()
        if offline is not None:
            offline.stop()


# ---- rounds ---------------------------------------------------------------------------------


def measure(
    server: ServerProcess, work: Workload, clients: int, args: argparse.Namespace
) -> dict[str, Any]:
    """A warm-up, then one round of `args.n` requests from `clients` clients: the issue's
    figures, the server's CPU by process, the engine's steps."""
    url = server.url
    load(url, work, clients, limit=min(WARM_UP_REQUESTS, args.n), args=args, pool=None)
    m0, c0 = engine_metrics(url), tree_cpu_seconds(server.process.pid)
    r = load(url, work, clients, limit=args.n, args=args, pool=None)
    c1, m1 = tree_cpu_seconds(server.process.pid), engine_metrics(url)
    row = r.summary()
    del row["refusals"]
    done = max(row["requests"], 1)
    row["server_cpu_ms_per_request"] = (c1["total"] - c0["total"]) / done * 1000
    row["server_cpu_ms_per_request_by_process"] = {
        role: (c1[role] - c0[role]) / done * 1000 for role in ("api", "engine", "other")
    }
    row["queue_drain_ms"] = clients / row["requests_per_s"] * 1000
    row["p99_over_drain"] = row["latency_ms"]["p99"] / row["queue_drain_ms"]
    steps = m1["steps"] - m0["steps"]
    row["engine"] = {
        "steps": steps,
        "inputs_per_step": (m1["inputs"] - m0["inputs"]) / max(steps, 1),
        "step_ms": (m1["step_seconds"] - m0["step_seconds"]) / max(steps, 1) * 1000,
        "busy": (m1["step_seconds"] - m0["step_seconds"]) / r.seconds,
    }
    return row


def summarize(rows: list[dict[str, Any]], isas: list[str], counts: list[int]) -> dict[str, Any]:
    """Per instruction set and client count, each figure's median over the rounds; the
    issue's targets read from those medians."""
    out: dict[str, Any] = {"lines": [], "targets": {}}
    few, many = min(counts), max(counts)
    for isa in isas:
        medians = {}
        for clients in counts:
            mine = [r for r in rows if r["isa"] == isa and r["clients"] == clients]
            medians[clients] = record.median_of_rounds(mine)
            m = medians[clients]
            by = m["server_cpu_ms_per_request_by_process"]
            out["lines"].append(
                f"{isa} {clients:3d} clients: {m['requests_per_s']:.1f} req/s, p50 "
                f"{m['latency_ms']['p50']:.0f} ms, p99 {m['latency_ms']['p99']:.0f} ms, drain "
                f"{m['queue_drain_ms']:.0f} ms (p99 {m['p99_over_drain']:.2f}x); server CPU "
                f"{m['server_cpu_ms_per_request']:.2f} ms/request (API {by['api']:.2f}, engine "
                f"{by['engine']:.2f}), offline {m['offline_cpu_ms_per_input']:.2f} ms/input; "
                f"{m['engine']['inputs_per_step']:.1f} inputs/step"
            )
        target = {
            "p99_over_drain": medians[many]["p99_over_drain"],
            "p99_over_drain_met": medians[many]["p99_over_drain"] <= P99_OVER_DRAIN_TARGET,
            "requests_per_s_many_over_few": medians[many]["requests_per_s"]
            / medians[few]["requests_per_s"],
        }
        target["throughput_met"] = target["requests_per_s_many_over_few"] >= 1.0
        out["targets"][isa] = target
        out["lines"].append(
            f"{isa}: at {many} clients p99 {target['p99_over_drain']:.2f}x the drain (target "
            f"<= {P99_OVER_DRAIN_TARGET}), req/s {target['requests_per_s_many_over_few']:.2f}x "
            f"{few} clients' (target >= 1)"
        )
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if args.offline_child is not None:
        offline_child(args.offline_child, args.n)
        return {}
    from vecpool.api import default_model_path

    report: dict[str, Any] = {
        **record.header(
            "bench_online_cpu.py",
            sys.argv[1:] if argv is None else argv,
            device="cpu",
            commit=args.commit,
        ),
        "isas": {},
        "rounds": [],
    }
    with tempfile.TemporaryDirectory(prefix="vecpool-online-cpu-") as tmp_name, ExitStack() as up:
        tmp = Path(tmp_name)
        model = args.model_dir or default_model_path()
        if args.synthetic is not None:
            model = write_folder(SHAPES[args.synthetic], tmp / "model", default_model_path(), "cpu")
        report["model"] = args.synthetic or (
            model.name if args.model_dir else "all-MiniLM-L6-v2 (packaged)"
        )
        texts = queries(model, args.n)
        work = Workload(
            "/v1/embeddings", [{"input": q, "encoding_format": "base64"} for q in texts], 0
        )
        # One instruction set at a time starts (each engine measures its CPU choice at load).
        running = {isa: up.enter_context(started(model, args, isa, tmp)) for isa in args.isa}
        for isa, (_, offline) in running.items():
            report["isas"][isa] = {"caps": CAPS[isa], **offline.info}
        for r in range(args.rounds):
            shift = r % len(args.isa)
            for isa in args.isa[shift:] + args.isa[:shift]:
                server, offline = running[isa]
                off = offline.run()
                for clients in args.clients:
                    row = {"round": r + 1, "isa": isa, "caps": CAPS[isa], "clients": clients}
                    row.update(measure(server, work, clients, args))
                    row["offline_cpu_ms_per_input"] = off["cpu_seconds"] / len(texts) * 1000
                    row["offline_inputs_per_s"] = len(texts) / off["seconds"]
                    row["load_average"] = os.getloadavg()[0]
                    report["rounds"].append(row)
                    print(
                        f"round {r + 1} {isa} {clients} clients: {row['requests_per_s']:.1f} "
                        f"req/s, p99 {row['p99_over_drain']:.2f}x the drain, server CPU "
                        f"{row['server_cpu_ms_per_request']:.2f} ms/request",
                        flush=True,
                    )
    report["summary"] = summarize(report["rounds"], args.isa, args.clients)
    report["load_average_at_end"] = list(os.getloadavg())
    for line in report["summary"]["lines"]:
        print(line)
    record.write(args.output, report)
    return report


if __name__ == "__main__":
    main()
