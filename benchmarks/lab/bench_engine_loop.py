"""The engine process's own cost per request under single-query clients: its loop
(`EngineLoop`: receive, submit, step, pool, finish, reply) fed over ZeroMQ by a client process
that keeps `--clients` one-query calls outstanding, with the model's forward replaced by a stub
that returns zeros (`bench_host.stub_engine`), so that what is timed is the loop's Python.

    PYTHONPATH=. python benchmarks/lab/bench_engine_loop.py [--clients 64] [--max-num-seqs 16]

On a GPU under many single-query clients the engine process, not the device, sets the pace:
each step holds a dozen inputs, and its Python per step and per request is the limit
(`bench_online.py`'s `engine busy`, `profile_phases.py --max-num-seqs`). Steps here hold at
most `--max-num-seqs` inputs, as a server's do at that load. Per round: the CPU time of the
loop's thread per request and per step (`time.thread_time`: the client process's time is not
in it, and the ids need no tokenizer), inputs per step, and how busy the loop's thread was.
The figure is the median of `--rounds` rounds, each kept. Its metrics are recorded in one
process's registry (a server's engine process writes them to files shared with the API
processes, which costs a little more).

`--against REV` times the loop of `vecpool/server/engine_process.py` as it is at git revision
REV too, in the same process on the same engine, rounds alternating (the order inside each
pair alternating too), and reports the ratio of the medians: an A/B of a change to the loop's
own module (the rest of the tree is the working tree's for both).
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import multiprocessing as mp
import statistics
import subprocess
import sys
import tempfile
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch
import zmq
from prometheus_client import CollectorRegistry

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks import record
from benchmarks.lab.bench_host import stub_engine
from vecpool.api import default_model_path
from vecpool.calls.outputs import PromptRequest
from vecpool.inputs.prompts import Prompt
from vecpool.server import wire
from vecpool.server.config import EngineProcessConfig
from vecpool.server.engine_process import EngineLoop
from vecpool.server.metrics import EngineMetrics
from vecpool.tasks import PoolingParams


def _clients(address: str, n: int, clients: int, done: Connection) -> None:
    """Send `n` one-query calls (U[8, 64] token ids), `clients` of them outstanding, then close
    `done` (which ends the engine loop)."""
    socket = zmq.Context().socket(zmq.DEALER)
    socket.connect(address)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(1000, 20000, size=int(rng.integers(8, 65))) for _ in range(256)]
    params = PoolingParams(task="embed")
    sent = answered = 0

    def send() -> None:
        nonlocal sent
        prompt = Prompt(token_ids=prompts[sent % len(prompts)], prompt_embeds=None)
        socket.send(wire.encoder.encode(wire.submit(sent, [PromptRequest(0, prompt, params)])))
        sent += 1

    for _ in range(min(clients, n)):
        send()
    while answered < n:
        for call in wire.replies.decode(socket.recv()).calls:
            answered += 1
            if not isinstance(call, wire.CallDone) or call.outputs[0].error is not None:
                raise RuntimeError(f"call {call.call_id} was not answered with a vector")
            if sent < n:
                send()
    socket.close(linger=0)
    done.close()


def loop_at(revision: str) -> type[EngineLoop]:
    """`EngineLoop` as `vecpool/server/engine_process.py` defines it at git `revision`."""
    path = "vecpool/server/engine_process.py"
    source = subprocess.run(
        ["git", "show", f"{revision}:{path}"],
        cwd=Path(__file__).resolve().parents[2],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    name = "engine_process_at_" + "".join(c if c.isalnum() else "_" for c in revision)
    spec = importlib.util.spec_from_loader(name, loader=None)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up
    exec(compile(source, f"{revision}:{path}", "exec"), module.__dict__)
    return cast(type[EngineLoop], module.EngineLoop)


def one_round(
    engine: Any, n: int, clients: int, loop_class: type[EngineLoop] = EngineLoop
) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as folder:
        address = f"ipc://{folder}/engine"
        metrics = EngineMetrics(CollectorRegistry())
        config = EngineProcessConfig(
            address=address, max_queued=max(4 * clients, 1024), batch_wait=0.002
        )
        loop = loop_class(engine, config, metrics)
        ends, done = mp.get_context("spawn").Pipe(duplex=False)
        client = mp.get_context("spawn").Process(target=_clients, args=(address, n, clients, done))
        client.start()
        done.close()
        steps = engine.core.num_steps
        wall, cpu = time.perf_counter(), time.thread_time()
        try:
            loop.run(ends)
        finally:
            cpu, wall = time.thread_time() - cpu, time.perf_counter() - wall
            loop.close()
            client.join()
        if client.exitcode != 0:
            raise RuntimeError(f"the client process failed (exit code {client.exitcode})")
    steps = engine.core.num_steps - steps
    return {
        "cpu_us_per_request": cpu / n * 1e6,
        "cpu_us_per_step": cpu / steps * 1e6,
        "inputs_per_step": n / steps,
        "busy": cpu / wall,
    }


def main(argv: list[str]) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--n", type=int, default=20000, help="calls per round")
    parser.add_argument("--clients", type=int, default=64, help="calls outstanding")
    parser.add_argument("--max-num-seqs", type=int, default=16, help="inputs per step at most")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tokenizer", type=Path, default=None, help="default: packaged MiniLM")
    parser.add_argument(
        "--against", metavar="REV", help="also time engine_process.py at git REV, alternating"
    )
    parser.add_argument("--output", type=Path)
    record.add_args(parser)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # as a server's engine process on a shared CPU: one thread
    report: dict[str, Any] = record.header(
        "lab/bench_engine_loop.py", argv, device="cpu", commit=args.commit
    )
    engine = stub_engine(args.tokenizer or default_model_path(), max_num_seqs=args.max_num_seqs)
    loops = {"tree": EngineLoop}
    if args.against:
        loops[args.against] = loop_at(args.against)
    for loop_class in loops.values():  # warm-up
        one_round(engine, min(args.n, 2000), args.clients, loop_class)
    gc.collect()
    gc.freeze()  # as the engine process does after loading
    per_round: dict[str, list[dict[str, float]]] = {name: [] for name in loops}
    for i in range(args.rounds):
        for name in list(loops)[:: 1 if i % 2 == 0 else -1]:
            per_round[name].append(one_round(engine, args.n, args.clients, loops[name]))
    report.update(clients=args.clients, max_num_seqs=args.max_num_seqs, calls_per_round=args.n)
    figures = {
        name: {key: record.rounds([r[key] for r in rounds]) for key in rounds[0]}
        for name, rounds in per_round.items()
    }
    report.update(figures.pop("tree"))
    for name, figure in figures.items():
        report["against"] = {"revision": name, **figure}
        report["cpu_per_request_ratio"] = (
            report["cpu_us_per_request"]["median"] / figure["cpu_us_per_request"]["median"]
        )
    for name, rounds in per_round.items():
        print(
            f"engine loop ({name}): "
            f"{statistics.median(r['cpu_us_per_request'] for r in rounds):.1f} µs/request, "
            f"{statistics.median(r['cpu_us_per_step'] for r in rounds):.0f} µs/step, "
            f"{statistics.median(r['inputs_per_step'] for r in rounds):.1f} inputs/step",
            flush=True,
        )
    if "cpu_per_request_ratio" in report:
        print(f"CPU per request, tree / {args.against}: {report['cpu_per_request_ratio']:.3f}")
    record.write(args.output, report)
    return report


if __name__ == "__main__":
    main(sys.argv[1:])
