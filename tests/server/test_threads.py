"""The thread budget of a server's processes: the rule (engine threads and API processes within
the cores, at least one thread an engine), the environment each child starts with, and a live
`vecpool serve` whose processes each compute with no more threads than they were given; and
first come, first served under a burst."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
import zmq

import vecpool
from tests.helpers import random_prompts
from tests.server import thread_probe
from tests.server.conftest import ServerPool, ServerSpec
from tests.server.test_engine_process import RunningLoop
from vecpool import calls
from vecpool.server import wire
from vecpool.server.threads import child_threads, thread_budget, thread_environment
from vecpool.tasks import PoolingParams


@pytest.mark.parametrize(
    ("cores", "apis", "engines", "engine"),
    [(4, 1, 1, 3), (8, 2, 1, 6), (16, 2, 2, 7), (16, 4, 3, 4), (32, 8, 1, 24)],
)
def test_cpu_engines_share_the_cores_the_api_processes_leave(
    cores: int, apis: int, engines: int, engine: int
) -> None:
    budget = thread_budget(cpu=True, cores=cores, api_processes=apis, engines=engines)
    assert budget.engine == engine and budget.api == 1
    # The API processes' cores leave the engines at least three quarters of the machine, and
    # the budget stays within the cores.
    assert engine * engines + apis <= cores and cores - apis >= 0.75 * cores


@pytest.mark.parametrize(
    ("cores", "apis", "engines", "engine"),
    [(2, 1, 1, 2), (3, 1, 1, 3), (2, 1, 2, 1), (4, 2, 1, 4), (2, 4, 1, 2), (3, 2, 2, 1)],
)
def test_on_a_small_machine_the_engines_share_every_core(
    cores: int, apis: int, engines: int, engine: int
) -> None:
    # A core kept per API process would leave the engines under three quarters of the
    # machine: they share all of it (at least one thread each), the API processes beside them.
    budget = thread_budget(cpu=True, cores=cores, api_processes=apis, engines=engines)
    assert budget.engine == engine and budget.api == 1
    assert engine == max(1, cores // engines)


def test_a_gpu_engine_keeps_torchs_threads() -> None:
    assert thread_budget(cpu=False, cores=16, api_processes=8, engines=2).engine is None


def test_children_start_with_the_budget_and_the_parent_environment_comes_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "7")
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    with child_threads(2):
        assert {k: os.environ[k] for k in thread_environment(2)} == {
            "OMP_NUM_THREADS": "2",
            "MKL_NUM_THREADS": "2",
            "OMP_WAIT_POLICY": "PASSIVE",
            "RAYON_NUM_THREADS": "2",
        }
        seen = subprocess.run(
            [sys.executable, "-c", "import torch; print(torch.get_num_threads())"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        assert seen.strip() == "2"
    assert os.environ["OMP_NUM_THREADS"] == "7" and "OMP_WAIT_POLICY" not in os.environ
    with child_threads(None):  # no budget: the environment as it is
        assert os.environ["OMP_NUM_THREADS"] == "7"


SERVERS = {
    # `vecpool serve` (the packaged model on the CPU, one API process), each child recording
    # its threads in the folder's `probe`.
    "probed_server": ServerSpec(
        lambda folder: ["--device", "cpu", "--api-server-count", "1"],
        module="tests.server.thread_probe",
        env=lambda folder: {thread_probe.ENV: str(_probe_folder(folder))},
    )
}


def _probe_folder(folder: Path) -> Path:
    (folder / "probe").mkdir(exist_ok=True)
    return folder / "probe"


@pytest.fixture
def probed_server(
    server_pool: ServerPool, request: pytest.FixtureRequest
) -> Iterator[tuple[str, Path]]:
    """(the server's URL, the folder its children record into)."""
    srv = server_pool.take(request, "probed_server")
    yield srv.url, server_pool.folder(request, "probed_server") / "probe"
    srv.stop()


def _records(probe: Path) -> dict[int, list[dict[str, Any]]]:
    return {
        int(f.stem): [json.loads(line) for line in f.read_text().splitlines()]
        for f in probe.glob("*.jsonl")
    }


def _torch_threads_started_with(threads: int) -> int:
    """The compute threads torch starts with in a new process given `threads` by the thread
    variables, as a server's child is."""
    env = {**os.environ, **thread_environment(threads)}
    code = "import torch; print(torch.get_num_threads())"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, check=True)
    return int(out.stdout)


def test_no_server_process_computes_with_more_threads_than_it_was_given(
    probed_server: tuple[str, Path],
) -> None:
    url, probe = probed_server
    texts = [" ".join(["word"] * n) for n in range(5, 200, 7)]
    for i in range(0, len(texts), 4):  # steps of several sizes, so that the pools start
        response = httpx.post(f"{url}/v1/embeddings", json={"input": texts[i : i + 4]}, timeout=60)
        assert response.status_code == 200
    records = _records(probe)
    engines = {pid: r for pid, r in records.items() if any(x["kind"] == "step" for x in r)}
    apis = {pid: r for pid, r in records.items() if pid not in engines}
    assert len(engines) == 1 and len(apis) == 1, records
    # Each child is named for its role, so that `top` and a benchmark tell their CPU apart.
    for pid, name in ((*engines, "vecpool-engine"), (*apis, "vecpool-api-0")):
        assert Path(f"/proc/{pid}/comm").read_text().strip() == name
    # The machine's compute threads as torch counts them (as the supervisor does), one API
    # process: the engine has the rest, or every core on a small machine.
    budget = thread_budget(cpu=True, cores=torch.get_num_threads(), api_processes=1, engines=1)
    given = {"engine": budget.engine, "api": 1}
    for kind, group in (("engine", engines), ("api", apis)):
        for rs in group.values():
            start = rs[0]
            assert start["kind"] == "start"
            # Before any of vecpool's code ran in the child: its pools were already sized, as
            # far as torch follows the variable (not above the cores it sees: a budget of
            # OMP_NUM_THREADS=8 less one on 2 cores starts torch with 2).
            assert start["torch_threads"] == _torch_threads_started_with(given[kind])
            assert start["env"] == {
                "OMP_NUM_THREADS": str(given[kind]),
                "MKL_NUM_THREADS": str(given[kind]),
                "OMP_WAIT_POLICY": "PASSIVE",
                "RAYON_NUM_THREADS": str(given[kind]),
            }
    (steps,) = ([r for r in rs if r["kind"] == "step"] for rs in engines.values())
    assert all(s["torch_threads"] == given["engine"] for s in steps)

    # The steps started no more compute threads than the engine was given (the thread that
    # steps computes too; the pool's workers start at the first parallel step).
    assert max(s["after"] for s in steps) - steps[0]["before"] <= given["engine"] - 1


def test_a_burst_is_served_first_come_first_served(
    tiny_bert: tuple[Path, Any], tmp_path: Path
) -> None:
    # Three inputs a step: twelve calls sent at once run in the order they came, whatever
    # their lengths (a long call early is not passed by short ones behind it). A flush answers
    # at most two steps: one pooled after the next one's forward, and that one.
    engine = vecpool.Engine(tiny_bert[0], device="cpu", max_num_seqs=3)
    address = f"ipc://{tmp_path}/engine"
    lengths = [40, 3, 9, 33, 5, 2, 27, 8, 16, 4, 21, 6]
    messages = [
        wire.submit(
            i,
            calls.make_requests(engine.context, random_prompts(99, [n], seed=i), PoolingParams()),
        )
        for i, n in enumerate(lengths)
    ]
    context = zmq.Context()
    socket = context.socket(zmq.DEALER)
    loop = RunningLoop(engine, address, max_queued=64, batch_wait=0.0)
    try:
        socket.connect(address)
        for message in messages:  # one burst
            socket.send(wire.encoder.encode(message))
        replies: list[list[int]] = []  # the calls each flush answered
        while sum(map(len, replies)) < len(messages):
            assert socket.poll(60_000), "no reply within a minute"
            done = wire.replies.decode(socket.recv()).calls
            assert all(isinstance(c, wire.CallDone) for c in done)
            replies.append(sorted(c.call_id for c in done))
    finally:
        socket.close(linger=0)
        context.term()
        loop.stop()
    assert [i for r in replies for i in r] == list(range(len(messages)))
    assert all(len(r) <= 6 for r in replies)
