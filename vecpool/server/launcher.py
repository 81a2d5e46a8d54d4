"""How `vecpool serve` runs: the processes of the server and the socket they share.

With `api_server_count` N >= 1 (the default), the server is N + M * D + 1 processes:

- this one, the supervisor: binds the listening socket, starts the others, and stops them;
- for each of the M models served (`vecpool serve A B`, default one), D engine processes
  (`data_parallel_size`, default 1; one per device, `EngineArgs.replicas`): each loads its
  model and runs the engine loop alone (`engine_process.EngineLoop`), fed over a ZeroMQ socket
  of its own (`ipc://`, a local Unix socket); on the CPU they share the cores (each gets an
  equal share of the threads);
- N API-server processes: uvicorn on the inherited listening socket (the kernel hands each new
  connection to one of them), doing HTTP, validation, tokenization and response encoding with
  no model (`app.create_api_app`), each call run whole by one engine process of the model it
  names: the live one to which this API process has the fewest prompt tokens in flight
  (`engine_group`, `served`).

Pipes tell each process when another is gone: the API processes see an engine process exit
(its calls in flight fail at once, no new call goes to it, /health answers 503 naming it, the
other engines go on), and every child sees this one exit (they stop). The supervisor restarts a
lost engine process and hands it to the API processes (`supervisor.py`). With `api_server_count`
0, one process serves: the engine loop in a thread beside the event loop (`app.create_app`), as
`vecpool.server.app` offers it for embedding in Python.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import logging
import math
import multiprocessing as mp
import os
import socket
import tempfile
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

from vecpool.api.args import EngineArgs
from vecpool.calls import EngineInfo
from vecpool.devices import cpu_threads, device_type
from vecpool.errors import ConfigError
from vecpool.server.config import EngineProcessConfig, ServerConfig
from vecpool.server.supervisor import (
    STOP_SECONDS,
    EngineProcess,
    RestartPolicy,
    Spawn,
    Supervisor,
    report_start_failure,
    stop,
    wait_ready,
)
from vecpool.server.threads import API_PROCESS_THREADS, child_threads, thread_budget

logger = logging.getLogger("vecpool.server")

# Connections waiting to be accepted before the kernel refuses more (capped by somaxconn).
LISTEN_BACKLOG = 4096
# The longest an idle engine gathers arriving requests into a step (`--batch-wait-ms`).
DEFAULT_BATCH_WAIT_MS = 2.0
# Seconds an idle keep-alive connection stays open (`--timeout-keep-alive`). Longer than
# clients keep idle connections in their pools (httpx and the OpenAI client: 5 s, aiohttp:
# 15 s): a client then always retires a connection first, and never sends on one the server is
# closing (which the server's kernel answers with a reset).
DEFAULT_KEEP_ALIVE = 75.0
# Seconds SIGTERM leaves requests in flight to finish before the server exits anyway.
DEFAULT_SHUTDOWN_TIMEOUT = 30.0
# Engine processes restarted within the window (all engines together) before the server stops,
# exit status 1, for its orchestrator to take over (`--max-engine-restarts`,
# `--engine-restart-window`).
DEFAULT_MAX_ENGINE_RESTARTS = 5
DEFAULT_ENGINE_RESTART_WINDOW = 300.0
# prctl's option that names the calling thread (the main thread's name is the process's).
PR_SET_NAME = 15


@dataclass(frozen=True)
class ServeOptions:
    """How the server runs (not what it serves: `EngineArgs`, `ServerConfig`)."""

    host: str = "127.0.0.1"
    port: int = 8000
    api_server_count: int = 1  # API-server processes; 0: one process, the engine in a thread
    batch_wait_ms: float = DEFAULT_BATCH_WAIT_MS  # an idle engine gathers a step this long
    timeout_keep_alive: float = DEFAULT_KEEP_ALIVE  # seconds an idle connection stays open
    shutdown_timeout: float = DEFAULT_SHUTDOWN_TIMEOUT  # SIGTERM: seconds to drain requests
    max_engine_restarts: int = DEFAULT_MAX_ENGINE_RESTARTS  # within the window, then exit 1
    engine_restart_window: float = DEFAULT_ENGINE_RESTART_WINDOW  # seconds
    log_level: str = "info"

    def __post_init__(self) -> None:
        if self.api_server_count < 0:
            raise ConfigError(f"--api-server-count must be 0 or more, got {self.api_server_count}")
        if not 0 <= self.batch_wait_ms <= 1000:
            raise ConfigError(f"--batch-wait-ms must be in [0, 1000], got {self.batch_wait_ms}")
        if self.timeout_keep_alive <= 0:
            raise ConfigError(
                f"--timeout-keep-alive must be positive, got {self.timeout_keep_alive}"
            )
        if self.shutdown_timeout < 0:
            raise ConfigError(f"--shutdown-timeout must be 0 or more, got {self.shutdown_timeout}")
        if self.max_engine_restarts < 0:
            raise ConfigError(
                f"--max-engine-restarts must be 0 or more, got {self.max_engine_restarts}"
            )
        if self.engine_restart_window <= 0:
            raise ConfigError(
                f"--engine-restart-window must be positive, got {self.engine_restart_window}"
            )


def default_api_server_count(device: Any) -> int:
    """API-server processes for this machine: one where the model runs on the CPU (it needs
    the cores); on a GPU host, one per two CPU cores, from one to eight (on a 16-core H200
    host, 8 served 4,090 single-query requests/s to 64 clients where 4 served 3,671)."""
    if device_type(device) == "cpu":
        return 1
    return min(8, max(1, (os.cpu_count() or 1) // 2))


def bind_socket(host: str, port: int) -> socket.socket:
    """The listening socket every API process accepts on."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP named, not left 0: asyncio sets TCP_NODELAY on the accepted connections only
    # then; without it a response's second write waits for the client's delayed ACK (~40 ms).
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise ConfigError(f"cannot listen on {host}:{port}: {exc.strerror}") from None
    sock.listen(LISTEN_BACKLOG)
    sock.set_inheritable(True)
    return sock


def uvicorn_config(app: Any, options: ServeOptions, config: ServerConfig) -> Any:
    import uvicorn

    from vecpool.server.connections import uvicorn_limits

    return uvicorn.Config(
        app,
        log_level=options.log_level,
        timeout_keep_alive=int(options.timeout_keep_alive),
        timeout_graceful_shutdown=math.ceil(options.shutdown_timeout),
        backlog=LISTEN_BACKLOG,
        **uvicorn_limits(config.read_timeout, config.max_connections),
    )


def serve_in_process(
    engine_args: EngineArgs, config: ServerConfig, options: ServeOptions, sock: socket.socket
) -> int:
    """One process: load the engine here and serve it until interrupted."""
    import uvicorn

    from vecpool.api import Engine
    from vecpool.server.app import create_app

    app = create_app(Engine.from_args(engine_args), config)
    uvicorn.Server(uvicorn_config(app, options, config)).run(sockets=[sock])
    return 0


def serve_processes(
    models: EngineArgs | Sequence[EngineArgs],
    config: ServerConfig,
    options: ServeOptions,
    sock: socket.socket,
) -> int:
    """Each model's engine processes (`models`, in the order of `config.served_model_names`)
    and `options.api_server_count` API processes, supervised until interrupted (SIGINT,
    SIGTERM) or until every API process has exited."""
    models = [models] if isinstance(models, EngineArgs) else list(models)
    logging.basicConfig(level=options.log_level.upper(), format="%(levelname)s:     %(message)s")
    with tempfile.TemporaryDirectory(prefix="vecpool-serve-") as tmp:
        # Every process records its metrics here and /metrics sums them; prometheus-client
        # reads the variable when a child imports it.
        metrics_dir = Path(tmp) / "metrics"
        metrics_dir.mkdir()
        with _environ("PROMETHEUS_MULTIPROC_DIR", str(metrics_dir)):  # for the children
            return _serve_processes(models, config, options, sock, tmp, metrics_dir)


@contextlib.contextmanager
def _environ(name: str, value: str) -> Iterator[None]:
    """`name=value` in this process's environment (which children start with) until exit."""
    previous = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if previous is None:
            del os.environ[name]
        else:
            os.environ[name] = previous


def check_layout(models: EngineArgs | Sequence[EngineArgs], options: ServeOptions) -> None:
    """Refuse, before any model loads, a data-parallel group or a set of models this layout or
    machine cannot run, or whose GPU memory fractions add up to more than a device."""
    models = [models] if isinstance(models, EngineArgs) else list(models)
    if len(models) > 1 and options.api_server_count == 0:
        raise ConfigError(
            f"{len(models)} models run one engine process each; --api-server-count 0 runs the "
            "engine in the API process: give --api-server-count 1 or more"
        )
    for engine_args in models:
        if engine_args.data_parallel_size > 1 and options.api_server_count == 0:
            raise ConfigError(
                "--data-parallel-size runs engine processes; --api-server-count 0 runs the "
                "engine in the API process: give --api-server-count 1 or more"
            )
        engine_args.replicas()  # raises when the devices are not there
    # Every model's group spans the same devices: each device holds one engine of each.
    fractions = [m.gpu_memory_fraction for m in models if m.gpu_memory_fraction is not None]
    if sum(fractions) > 1 + 1e-9:
        raise ConfigError(
            f"--gpu-memory-fraction: the models' shares ({', '.join(f'{f:g}' for f in fractions)}) "
            f"add up to {sum(fractions):g}, more than the whole of a device; each device runs "
            "one engine of every model"
        )


def _serve_processes(  # the body of `serve_processes`, inside its directory and environment
    models: Sequence[EngineArgs],
    config: ServerConfig,
    options: ServeOptions,
    sock: socket.socket,
    tmp: str,
    metrics_dir: Path,
) -> int:
    # Imported here, once PROMETHEUS_MULTIPROC_DIR is set: prometheus-client reads it on import,
    # and the supervisor's counter must land in the directory that /metrics sums.
    from vecpool.server.metrics import SupervisorMetrics

    ctx = mp.get_context("spawn")
    # Children see EOF on this when this process is gone.
    parent_alive, parent_writer = ctx.Pipe(duplex=False)
    engines = _start_engines(ctx, models, options, config, tmp, parent_alive)
    results = []
    for e in engines:
        assert e.ready is not None
        results.append(wait_ready(e.process, e.ready))
        e.ready = None
    infos: list[EngineInfo] = []  # each model's, from its first engine
    for e, result in zip(engines, results, strict=True):
        if not isinstance(result, EngineInfo):  # one failed to load: stop the others
            parent_writer.close()
            stop([e.process for e in engines], STOP_SECONDS)
            return report_start_failure(result)
        if e.rank == 0:
            infos.append(result)
    labels = _model_labels(config)
    # One duplex pipe per API process: the supervisor hands it each restarted engine process.
    controls = [ctx.Pipe(duplex=True) for _ in range(options.api_server_count)]
    apis = [
        ctx.Process(
            target=run_api_process,
            args=(infos, config, options, sock, [(e.model, e.address, e.name) for e in engines]),
            kwargs={
                "engine_alive": [e.alive for e in engines],
                "parent_alive": parent_alive,
                "control": theirs,
                "metrics_dir": str(metrics_dir),
            },
            name=f"vecpool-api-{i}",
        )
        for i, (_, theirs) in enumerate(controls)
    ]
    for api in apis:
        with child_threads(API_PROCESS_THREADS):  # it runs no model: one compute thread
            api.start()
    for e in engines:  # the API processes hold theirs now
        assert e.alive is not None
        e.alive.close()
        e.alive = None
    for _, theirs in controls:
        theirs.close()
    pids = ", ".join(str(e.process.pid) for e in engines)
    logger.info(
        "serving %s on http://%s:%d: %s, API-server processes (pids %s)",
        ", ".join(info.model_name for info in infos),
        options.host,
        options.port,
        f"engine process (pid {pids})" if len(engines) == 1 else f"engine processes (pids {pids})",
        ", ".join(str(api.pid) for api in apis),
    )
    metrics = SupervisorMetrics(None, [(labels[e.model], e.rank) for e in engines])
    supervisor = Supervisor(
        engines,
        apis,
        [ours for ours, _ in controls],
        RestartPolicy(options.max_engine_restarts, options.engine_restart_window),
        grace=options.shutdown_timeout,
        on_restart=lambda e: metrics.engine_restarts(labels[e.model], e.rank).inc(),
    )
    try:
        return supervisor.run()
    finally:
        parent_writer.close()
        for ours, _ in controls:
            ours.close()


def _model_labels(config: ServerConfig) -> list[str | None]:
    """Each model's `model` label in the metrics (its first served name); None with one model."""
    names = config.served_model_names
    return [n[0] if len(names) > 1 else None for n in names]


def _start_engines(
    ctx: Any,
    models: Sequence[EngineArgs],
    options: ServeOptions,
    config: ServerConfig,
    tmp: str,
    parent_alive: Connection,
) -> list[EngineProcess]:
    """Start an engine process on each device of each model's group (they load at once)."""
    labels = _model_labels(config)
    groups = [engine_args.replicas() for engine_args in models]
    # On the CPU the engines share the cores the API processes leave.
    budget = thread_budget(
        cpu=device_type(groups[0][0].args.device or "cpu") == "cpu",
        cores=cpu_threads(),
        api_processes=options.api_server_count,
        engines=sum(len(replicas) for replicas in groups),
    )
    engines = []
    for index, replicas in enumerate(groups):
        label = labels[index]
        group = len(replicas) > 1
        for replica in replicas:
            rank = replica.rank
            name = (
                f"engine process {rank} ({replica.args.device})" if group else "the engine process"
            )
            if label is not None:
                name += f" of model {label!r}"
            engine_config = EngineProcessConfig(
                address=f"ipc://{tmp}/engine-{index}-{rank}",
                max_queued=config.max_queued,
                max_wait=config.max_queue_wait,
                batch_wait=options.batch_wait_ms / 1000,
                model=label,
            )
            # Several engines on one machine share its cores: each gets an equal share.
            shared = group or len(models) > 1
            threads = budget.engine or (max(1, replica.threads // len(models)) if shared else None)
            tag = f"engine {rank}" if group else "engine"
            if label is not None:
                tag += f" {label}"
            spawn = _spawner(ctx, replica.args, engine_config, threads, tag, parent_alive, options)
            process, alive, ready = spawn()
            logger.info("%s started (pid %s), loading the model", name, process.pid)
            engines.append(
                EngineProcess(
                    rank, name, engine_config.address, spawn, process, alive, ready, model=index
                )
            )
    return engines


def _spawner(
    ctx: Any,
    args: EngineArgs,
    engine_config: EngineProcessConfig,
    threads: int | None,
    tag: str,
    parent_alive: Connection,
    options: ServeOptions,
) -> Spawn:
    """What starts one engine process (again, after a loss: on the same device and address)."""

    def spawn() -> tuple[BaseProcess, Connection, Connection]:
        alive, alive_w = ctx.Pipe(duplex=False)
        ready, ready_w = ctx.Pipe(duplex=False)
        process = ctx.Process(
            target=_engine_main,
            args=(args, engine_config, ready_w, parent_alive, alive_w),
            kwargs={"log_level": options.log_level, "threads": threads, "tag": tag},
            name=f"vecpool-{tag.replace(' ', '-')}",
        )
        with child_threads(threads):
            process.start()
        ready_w.close()
        alive_w.close()  # the engine process holds the only writer now
        return process, alive, ready

    return spawn


def name_this_process() -> None:
    """This child's process name (`vecpool-api-0`, `vecpool-engine`: what `top`, `ps -o comm`
    and /proc/PID/comm show, so that each process's CPU is told apart), from its
    multiprocessing name, cut to the 15 bytes Linux keeps; nothing where there is no prctl."""
    name = mp.current_process().name.encode()[:15]
    with contextlib.suppress(OSError, AttributeError, TypeError):  # no prctl: not Linux
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_NAME, ctypes.c_char_p(name), 0, 0, 0)


def _engine_main(*args: Any, **kwargs: Any) -> None:
    """An engine process's entry point: the engine (and torch) load here, in that process,
    never in this one (the supervisor) or in the API processes."""
    from vecpool.server.engine_process import run_engine_process

    name_this_process()
    run_engine_process(*args, **kwargs)


def run_api_process(
    infos: Sequence[EngineInfo],
    config: ServerConfig,
    options: ServeOptions,
    sock: socket.socket,
    engines: Sequence[tuple[int, str, str]],
    *,
    engine_alive: Sequence[Connection],
    parent_alive: Connection,
    control: Connection,
    metrics_dir: str,
) -> None:
    """An API-server process's entry point: uvicorn on `sock` until stopped, or until the
    supervisor is gone. `infos`: each served model's; `engines`: each engine process's
    (model, address, name), by model and rank; `engine_alive`: the pipe that closes when it
    exits; `control`: where the supervisor hands over each restarted engine process."""
    import uvicorn

    from vecpool.server.app import create_api_app
    from vecpool.server.engine_client import EngineProcessClient
    from vecpool.server.engine_group import EngineGroupClient
    from vecpool.server.metrics import EngineGroupMetrics
    from vecpool.server.served import ServedModelsClient

    name_this_process()
    # No torch here: its compute threads were set through the environment it started with
    # (`child_threads`), which numpy and the tokenizer read.
    by_model: list[list[EngineProcessClient]] = [[] for _ in infos]
    for (model, address, name), alive in zip(engines, engine_alive, strict=True):
        client = EngineProcessClient(address, alive, max_queued=config.max_queued, name=name)
        by_model[model].append(client)
    # Recorded into the multiprocess directory, which /metrics reads whole.
    groups = [
        EngineGroupClient(clients, EngineGroupMetrics(None, model=label))
        for clients, label in zip(by_model, _model_labels(config), strict=True)
    ]
    served = ServedModelsClient(groups, control=control)
    app = create_api_app(infos, config, served, multiprocess_dir=metrics_dir)
    server = uvicorn.Server(uvicorn_config(app, options, config))

    def watch_parent() -> None:
        with contextlib.suppress(EOFError, OSError):
            parent_alive.recv()
        server.should_exit = True

    threading.Thread(target=watch_parent, name="vecpool-parent-watch", daemon=True).start()
    gc.collect()
    gc.freeze()  # start-up's objects stay: the collector's full passes need not walk them
    server.run(sockets=[sock])
