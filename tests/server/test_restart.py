"""The supervisor restarts a lost engine process: real `vecpool serve` processes, a tiny model.

SIGKILL of the engine process under load: every request is answered, correctly or 503, none
hangs; while the engine is gone a new call gets 503 with Retry-After and /health 503 names it
(the supervisor is held with SIGSTOP meanwhile, so that the restart cannot outrun the checks);
the restarted engine answers what the first one did, and the restart counter says 1. An engine
whose every forward raises exits, is restarted `--max-engine-restarts` times, and then the
server exits with status 1. (Data parallel: `test_data_parallel.py`, the killed engine comes
back while the other serves throughout.)
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import pytest
import transformers

import vecpool
from tests.helpers import random_prompts, save_hf_model
from tests.server.conftest import STARTUP_SECONDS, Server, ServerPool, ServerSpec, assert_error
from tests.server.test_engine_process import RunningLoop
from tests.server.test_processes import _alive, _pids
from tests.tasks.conftest import tiny_bert_head, with_minilm_tokenizer
from vecpool import calls
from vecpool.errors import EngineDeadError
from vecpool.server import engine_client, supervisor
from vecpool.server.engine_client import EngineProcessClient
from vecpool.server.supervisor import RestartPolicy
from vecpool.tasks import PoolingParams

# An input batched with others runs through matrix products of other shapes; their float32
# sums round differently (well below this on the tiny model).
BATCHING_TOLERANCE = 1e-6
WAIT = 120.0  # seconds for anything to happen: generous, for a loaded 2-core machine
TEXTS = [f"a sentence about restarts number {i}" for i in range(16)]
# Run as a script, not with -m: processes started with "spawn" run a script's top level again,
# so this patch reaches the engine processes (and every later one), where the model runs.
BROKEN_SERVE = """
import multiprocessing
import sys

if multiprocessing.current_process().name.startswith("vecpool-engine"):
    from vecpool.runner.model_runner import ModelRunner

    def broken(self, batch):
        raise RuntimeError("device lost")

    ModelRunner.forward = broken

if __name__ == "__main__":
    from vecpool.cli.main import main

    sys.exit(main())
"""


def _tiny_model(folder: Path, default_model_dir: Path) -> list[str]:
    """A random 2-layer BERT (hidden 32, 128 positions) on the MiniLM tokenizer."""
    model = save_hf_model(tiny_bert_head(transformers.BertModel), folder / "model")
    return [str(with_minilm_tokenizer(model, default_model_dir))]


# One server for the stopped-engine and killed-engine tests, in that order: the stopped
# engine (continued, no restart), then the killed one (restarted).
SERVERS = {
    "restart_server": ServerSpec(_tiny_model, fixtures=("default_model_dir",), log_level="info")
}


@pytest.fixture(scope="module")
def tiny_dir(server_pool: ServerPool, request: pytest.FixtureRequest) -> Path:
    return server_pool.folder(request, "restart_server") / "model"


@pytest.fixture(scope="module")
def tiny_engine(tiny_dir: Path) -> vecpool.Engine:
    return vecpool.Engine(tiny_dir, device="cpu")


def _until(what: str, predicate, timeout: float = WAIT, log: Path | None = None) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(
                f"{what}: not within {timeout:g} s"
                + (f"; the log:\n{log.read_text()}" if log else "")
            )
        time.sleep(0.05)


def _health(server: Server) -> httpx.Response:
    return server.client.get("/health")


class Load:
    """Threads posting one text at a time until stopped; every outcome kept, in the order
    answered: (text index, status, vector or None), or an exception's name."""

    def __init__(self, server: Server, threads: int = 3):
        self.server = server
        self.stopping = threading.Event()
        self.outcomes: list[tuple[int, int, np.ndarray | None]] = []
        self.errors: list[str] = []
        self.threads = [threading.Thread(target=self._post, args=(k,)) for k in range(threads)]
        for thread in self.threads:
            thread.start()

    def _post(self, first: int) -> None:
        with httpx.Client(base_url=self.server.url, timeout=WAIT) as http:
            i = first
            while not self.stopping.is_set():
                try:
                    response = http.post("/v1/embeddings", json={"input": TEXTS[i % len(TEXTS)]})
                except httpx.HTTPError as exc:  # a hang ends as a timeout: a failure
                    self.errors.append(type(exc).__name__)
                    continue
                vector = None
                if response.status_code == 200:
                    vector = np.array(response.json()["data"][0]["embedding"], np.float32)
                self.outcomes.append((i % len(TEXTS), response.status_code, vector))
                if response.status_code == 503:  # as a client honouring Retry-After would
                    time.sleep(float(response.headers.get("retry-after", "0.2")))
                i += len(self.threads)

    def answered(self, since: int = 0) -> int:
        """Answers with a vector among the outcomes from the `since`-th on."""
        return sum(1 for _, status, _ in self.outcomes[since:] if status == 200)

    def stop(self) -> None:
        self.stopping.set()
        for thread in self.threads:
            thread.join(timeout=WAIT)
            assert not thread.is_alive(), "a request hung"


@pytest.fixture(scope="module")
def restart_server(server_pool: ServerPool, request: pytest.FixtureRequest) -> Iterator[Server]:
    srv = server_pool.take(request, "restart_server")
    yield srv
    os.kill(srv.process.pid, signal.SIGCONT)  # in case a test left the supervisor held
    srv.stop()


def test_a_stopped_engine_fails_health_and_serves_again_when_continued(
    restart_server: Server, tiny_engine: vecpool.Engine
) -> None:
    """An engine process that lives but does not answer (SIGSTOP: as one hung in a device
    call) turns /health to 503 once HEALTH_WAIT has passed, naming it; continued, it answers
    what waited and /health is 200 again, with no restart."""
    server = restart_server
    engine_pid, _ = _pids(server)
    assert _health(server).status_code == 200
    pool = ThreadPoolExecutor(1)
    os.kill(engine_pid, signal.SIGSTOP)
    try:
        waiting = pool.submit(server.post, "/v1/embeddings", {"input": TEXTS[0]})
        time.sleep(engine_client.HEALTH_FRESH)  # what an API process heard before is older
        message = assert_error(_health(server), 503)
        # The check asked the engine and gave up after HEALTH_WAIT (5 s), the engine stopped.
        assert "the engine process did not answer within 5 s; it may be stuck" in message
        assert not waiting.done()
    finally:
        os.kill(engine_pid, signal.SIGCONT)
        pool.shutdown(wait=False)
    answered = waiting.result(timeout=WAIT)
    assert answered.status_code == 200, answered.text
    vector = np.array(answered.json()["data"][0]["embedding"], np.float32)
    assert np.abs(vector - tiny_engine.embed(TEXTS[:1])[0]).max() <= BATCHING_TOLERANCE
    _until("/health 200 again", lambda: _health(server).status_code == 200, log=server.log)
    assert server.metric("vecpool_engine_restarts_total", engine="0") == 0
    assert _alive(engine_pid)


def test_sigkill_under_load_restarts_the_engine(
    restart_server: Server, tiny_engine: vecpool.Engine
) -> None:
    server = restart_server
    expected = tiny_engine.embed(TEXTS)
    before = server.post("/v1/embeddings", {"input": TEXTS[:4]})
    assert before.status_code == 200, before.text
    assert server.metric("vecpool_engine_restarts_total", engine="0") == 0
    engine_pid, api_pids = _pids(server)
    load = Load(server)
    try:
        _until("answers under load", lambda: load.answered() >= 6)
        os.kill(server.process.pid, signal.SIGSTOP)  # hold the supervisor: no restart yet
        os.kill(engine_pid, signal.SIGKILL)
        _until("/health 503", lambda: _health(server).status_code == 503)
        health = _health(server)
        assert_error(health, 503)
        assert "the engine process exited; restarting" in health.json()["error"]["message"]
        refused = server.post("/v1/embeddings", {"input": "while it restarts"})
        assert "restarting" in assert_error(refused, 503)
        assert refused.headers["retry-after"] == "1"
        os.kill(server.process.pid, signal.SIGCONT)
        _until("/health 200 again", lambda: _health(server).status_code == 200, log=server.log)
        back = len(load.outcomes)  # what comes after this was answered after /health 200
        _until("answers after the restart", lambda: load.answered(since=back) >= 6)
    finally:
        os.kill(server.process.pid, signal.SIGCONT)
        load.stop()
    assert load.errors == []
    statuses = {status for _, status, _ in load.outcomes}
    assert statuses <= {200, 503} and 503 in statuses, statuses
    for index, status, vector in load.outcomes:
        if status == 200:
            assert vector is not None
            assert np.abs(vector - expected[index]).max() <= BATCHING_TOLERANCE
    after = server.post("/v1/embeddings", {"input": TEXTS[:4]})
    assert after.status_code == 200, after.text
    got = [np.array(d["embedding"], np.float32) for d in after.json()["data"]]
    was = [np.array(d["embedding"], np.float32) for d in before.json()["data"]]
    assert np.abs(np.stack(got) - np.stack(was)).max() <= BATCHING_TOLERANCE
    assert server.metric("vecpool_engine_restarts_total", engine="0") == 1
    new_pid, same_apis = _pids_after_restart(server)
    assert new_pid != engine_pid and _alive(new_pid) and not _alive(engine_pid)
    assert same_apis == api_pids and all(_alive(pid) for pid in api_pids)


def _pids_after_restart(server: Server) -> tuple[int, list[int]]:
    """(the restarted engine's pid, the API pids) from the supervisor's log."""
    _, api_pids = _pids(server)
    for line in server.log.read_text().splitlines():
        if "the engine process restarted (pid" in line:
            return int(line.split("(pid ")[1].split(")")[0]), api_pids
    raise AssertionError(f"no restart in the log:\n{server.log.read_text()}")


def test_a_broken_engine_restarts_then_the_server_exits(tiny_dir: Path, tmp_path: Path) -> None:
    """Every forward raises: each engine process exits at fault once it is sent a call, is
    restarted twice (`--max-engine-restarts 2`), and the third exit stops the server, status 1,
    with one line saying why. Calls meanwhile fail (500 in a step, 503 on the way out or while
    it restarts), never hang."""
    script = tmp_path / "broken_serve.py"
    script.write_text(BROKEN_SERVE)
    log = tmp_path / "server.log"
    port = _free_port()
    cmd = [sys.executable, str(script), "serve", str(tiny_dir), "--port", str(port)]
    cmd += ["--log-level", "info", "--max-engine-restarts", "2"]
    with log.open("wb") as out:
        process = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    server = Server(process, f"http://127.0.0.1:{port}", log, None)
    statuses: set[int] = set()
    try:
        _until("/health 200", lambda: _healthy(server), STARTUP_SECONDS)
        deadline = time.monotonic() + 3 * WAIT
        while process.poll() is None:
            assert time.monotonic() < deadline, f"the server did not exit:\n{log.read_text()}"
            try:
                response = server.post("/v1/embeddings", {"input": "hello"}, timeout=WAIT)
            except httpx.TimeoutException:
                raise
            except httpx.TransportError:  # stopping: the API processes close, or are gone
                continue
            statuses.add(response.status_code)
            if response.status_code == 503:
                time.sleep(0.2)
        assert process.wait() == 1
    finally:
        server.stop()
    text = log.read_text()
    # 500 when the call's failure came before the process's exit, 503 when its exit came first.
    assert statuses and statuses <= {500, 503}, statuses
    assert text.count("the engine process exited (1)") == 3, text  # each exited at fault
    assert text.count("the engine process restarted (pid") == 2, text
    assert text.count("stopping the server for its orchestrator to take over") == 1, text


def _healthy(server: Server) -> bool:
    try:
        return _health(server).status_code == 200
    except httpx.TransportError:
        assert server.process.poll() is None, server.log.read_text()
        return False


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_the_back_off_doubles_per_engine_and_the_limit_spans_the_window() -> None:
    policy = RestartPolicy(max_restarts=4, window=100.0)
    assert policy.delay(0, now=0.0) == supervisor.RESTART_DELAY
    assert policy.delay(0, now=1.0) == 2 * supervisor.RESTART_DELAY
    assert policy.delay(1, now=2.0) == supervisor.RESTART_DELAY  # its own first restart
    assert policy.delay(0, now=3.0) == 4 * supervisor.RESTART_DELAY
    assert policy.delay(1, now=4.0) is None  # 4 restarts within 100 s: stop
    assert policy.delay(1, now=100.5) == 2 * supervisor.RESTART_DELAY  # the first aged out
    many = RestartPolicy(max_restarts=100, window=1e9)
    assert (
        max(many.delay(0, now=float(t)) or 0.0 for t in range(20)) == supervisor.RESTART_MAX_DELAY
    )
    assert RestartPolicy(max_restarts=0, window=1.0).delay(0, now=0.0) is None


def test_a_client_takes_the_restarted_process_on_a_fresh_socket(
    tiny_bert_engine: vecpool.Engine, tmp_path: Path
) -> None:
    """In one process: the engine's alive pipe closes (its exit): calls fail, the client is
    not running and says it restarts; a new engine loop on the same address, handed over as
    generation 1, serves the next calls; a stale hand-over (generation 1 again) is ignored."""
    address = f"ipc://{tmp_path}/engine"
    ctx = tiny_bert_engine.context
    requests = calls.make_requests(ctx, random_prompts(99, [5, 7], seed=3), PoolingParams())
    expected = tiny_bert_engine.embed(random_prompts(99, [5, 7], seed=3))
    first_alive, first_writer = mp.Pipe(duplex=False)
    loop = RunningLoop(tiny_bert_engine, address)

    async def scenario() -> None:
        nonlocal loop
        client = EngineProcessClient(address, first_alive, max_queued=8)
        await client.start()
        try:
            assert len(await client.run(requests)) == 2
            loop.stop()  # the process is gone: its loop, then its pipe
            first_writer.close()
            await _until_async(lambda: not client.is_running)
            assert client.health_problem == "the engine process exited; restarting"
            with pytest.raises(EngineDeadError, match="restarting"):
                await client.run(requests)
            loop = RunningLoop(tiny_bert_engine, address)  # the restarted process
            alive, writer = mp.Pipe(duplex=False)
            client.restarted(1, alive)
            assert client.is_running and client.generation == 1
            outs = await client.run(requests)
            got = np.stack([o.data for o in outs])
            assert np.abs(got - expected).max() <= BATCHING_TOLERANCE
            stale, stale_writer = mp.Pipe(duplex=False)
            client.restarted(1, stale)  # not newer: ignored (and its pipe closed)
            assert stale.closed and client.generation == 1 and client.is_running
            stale_writer.close()
            writer.close()
            await _until_async(lambda: not client.is_running)
        finally:
            await client.close()

    try:
        asyncio.run(asyncio.wait_for(scenario(), WAIT))
    finally:
        loop.stop()


async def _until_async(predicate) -> None:  # type: ignore[no-untyped-def]
    while not predicate():
        await asyncio.sleep(0.01)
