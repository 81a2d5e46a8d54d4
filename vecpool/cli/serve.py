"""`vecpool serve`: the command line of the HTTP server.

`add_serve_arguments(parser)` adds the options to a parser; `serve(args)` runs the server's
processes (`vecpool.server.launcher`) until stopped. Nothing of the `server` extra is imported
until `serve` runs.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

from vecpool.api.args import EngineArgs
from vecpool.calls.options import fields_from
from vecpool.cli.common import error_text
from vecpool.errors import ConfigError, VecpoolError
from vecpool.server import launcher

DEFAULT_BATCH_INPUTS = 2048
SERVE_DESCRIPTION = """\
Serve pooling models over HTTP: OpenAI /v1/embeddings, /pooling, /rerank (Cohere, Jina),
/score, /classify, /tokenize, /detokenize, /v1/models, /health, /metrics (Prometheus).
Several models (`vecpool serve A B`) run one engine each; a call's `model` picks one.
"""


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the `serve` options to `parser`."""
    # Prompt embeds arrive as base64 blobs from any client: refused unless asked for.
    EngineArgs.add_cli_args(parser, enable_prompt_embeds=False, several_models=True)
    http = parser.add_argument_group("HTTP")
    http.add_argument("--host", default="127.0.0.1", help="address to bind (default: %(default)s)")
    http.add_argument("--port", type=int, default=8000, help="port (default: %(default)s)")
    http.add_argument(
        "--served-model-name",
        nargs="+",
        action="append",
        metavar="NAME",
        help="names clients may send in `model`; the first is reported (default: the folder "
        "name). With several models, give it once per model, in their order; a call that "
        "names no model goes to the first",
    )
    http.add_argument(
        "--api-key",
        metavar="KEY",
        help="require 'Authorization: Bearer KEY' (not on /health, /metrics)",
    )
    http.add_argument(
        "--log-level",
        default="info",
        choices=("critical", "error", "warning", "info", "debug"),
        help="uvicorn's log level (default: %(default)s)",
    )
    limits = parser.add_argument_group("limits")
    limits.add_argument(
        "--max-queued",
        type=int,
        default=4096,
        metavar="N",
        help="inputs waiting or running before new requests get 429 (default: %(default)s)",
    )
    limits.add_argument(
        "--max-queue-wait",
        type=float,
        default=10.0,
        metavar="SECONDS",
        help="seconds of work (queued tokens at the engine's measured speed) ahead of a new "
        "request before it gets 429, answered before its body is read; bounds how long an "
        "admitted request waits (default: %(default)s)",
    )
    limits.add_argument(
        "--timeout-read",
        type=float,
        default=30.0,
        metavar="SECONDS",
        help="a request's headers and body must arrive within this long of its first byte "
        "(of the connection, for a new one), else 408 and the connection closes "
        "(default: %(default)s)",
    )
    limits.add_argument(
        "--max-connections",
        type=int,
        default=8192,
        metavar="N",
        help="open connections per API-server process; past it a new one is answered 503 "
        "and closed. The open-file limit is raised to fit where the hard limit allows "
        "(default: %(default)s)",
    )
    limits.add_argument(
        "--max-batch-inputs",
        type=int,
        metavar="N",
        help=f"inputs one request may hold (default: {DEFAULT_BATCH_INPUTS} or --max-queued)",
    )
    limits.add_argument(
        "--max-payload-mb",
        type=float,
        default=32.0,
        metavar="MB",
        help="request body limit, 413 above it (default: %(default)s)",
    )
    limits.add_argument(
        "--max-answer-values",
        type=int,
        default=2**24,
        metavar="N",
        help="values a per-token answer (/pooling's token_embed and token_classify, TEI's "
        "/embed_all) may hold, its tokens times a token's width, checked before it runs; a "
        "400 above it (default: %(default)s)",
    )
    limits.add_argument(
        "--auto-truncate",
        action="store_true",
        help="truncate inputs longer than --max-model-len instead of refusing them",
    )
    procs = parser.add_argument_group("processes and batching")
    procs.add_argument(
        "--api-server-count",
        type=int,
        metavar="N",
        help="API-server processes (HTTP, validation, tokenization) beside the engine process; "
        "0: one process, the engine in a thread (default: 1 when the model runs on the CPU, "
        "else one per 2 CPU cores, at most 8)",
    )
    procs.add_argument(
        "--batch-wait-ms",
        type=float,
        default=launcher.DEFAULT_BATCH_WAIT_MS,
        metavar="MS",
        help="when the engine is idle and requests arrive, take more while they keep coming "
        "(each within 1 ms of the last), for at most this long, before it steps "
        "(default: %(default)s)",
    )
    procs.add_argument(
        "--max-engine-restarts",
        type=int,
        default=launcher.DEFAULT_MAX_ENGINE_RESTARTS,
        metavar="N",
        help="a lost engine process (killed, or exited at fault) is restarted, after a back-off "
        "of 0.5 s doubling to 30 s; past N restarts within --engine-restart-window the server "
        "exits with status 1, for its orchestrator to take over (0: the first loss does) "
        "(default: %(default)s)",
    )
    procs.add_argument(
        "--engine-restart-window",
        type=float,
        default=launcher.DEFAULT_ENGINE_RESTART_WINDOW,
        metavar="SECONDS",
        help="the window in which --max-engine-restarts counts restarts (default: %(default)s)",
    )
    http.add_argument(
        "--timeout-keep-alive",
        type=float,
        default=launcher.DEFAULT_KEEP_ALIVE,
        metavar="SECONDS",
        help="close idle keep-alive connections after this long; keep it above your clients' "
        "and load balancers' idle timeouts (default: %(default)s)",
    )
    http.add_argument(
        "--shutdown-timeout",
        type=float,
        default=launcher.DEFAULT_SHUTDOWN_TIMEOUT,
        metavar="SECONDS",
        help="on SIGTERM or SIGINT, stop accepting and let requests in flight finish for at "
        "most this long before exiting (default: %(default)s)",
    )
    http.add_argument(
        "--tokenizer-threads",
        type=int,
        default=4,
        metavar="N",
        help="threads that tokenize and validate inputs (default: %(default)s)",
    )


def serve(args: argparse.Namespace) -> int:
    """Serve until interrupted (the processes of `vecpool.server.launcher`); the exit status."""
    try:
        import uvicorn  # noqa: F401
        import zmq  # noqa: F401
    except ImportError as exc:
        print(
            f"vecpool serve: the server needs the `server` extra (pip install 'vecpool[server]'): {exc}",
            file=sys.stderr,
        )
        return 2
    from vecpool.server.config import ServerConfig
    from vecpool.server.connections import raise_open_file_limit

    try:
        models = EngineArgs.per_model(args)
        names = served_model_names(args.served_model_name, models)
        # Each field the flag of its name (--max-queued: max_queued) unless given here; checked
        # before the model loads: fail fast.
        config = fields_from(
            ServerConfig,
            args,
            model_names=names[0],
            other_model_names=names[1:],
            max_batch_inputs=(
                args.max_batch_inputs
                if args.max_batch_inputs is not None
                else min(DEFAULT_BATCH_INPUTS, args.max_queued)
            ),
            max_payload_bytes=int(args.max_payload_mb * 2**20),
            read_timeout=args.timeout_read,
        )
        fit = raise_open_file_limit(config.max_connections)  # children inherit the limit
        if fit < config.max_connections:
            config = dataclasses.replace(config, max_connections=fit)
        count = args.api_server_count
        options = fields_from(
            launcher.ServeOptions,
            args,
            api_server_count=(
                launcher.default_api_server_count(models[0].device) if count is None else count
            ),
        )
        launcher.check_layout(models, options)
        sock = launcher.bind_socket(args.host, args.port)
    except VecpoolError as exc:
        print(f"vecpool serve: {error_text(exc, args)}", file=sys.stderr)
        return 2
    with sock:
        if options.api_server_count == 0:  # one model (check_layout refuses more)
            return launcher.serve_in_process(models[0], config, options, sock)
        return launcher.serve_processes(models, config, options, sock)


def served_model_names(
    given: list[list[str]] | None, models: list[EngineArgs]
) -> tuple[tuple[str, ...], ...]:
    """Each model's names: those given (`--served-model-name`, once per model), else its
    folder's name."""
    if given is None:
        return tuple((m.model_name,) for m in models)
    if len(given) != len(models):
        raise ConfigError(
            f"--served-model-name is given {len(given)} times for {len(models)} "
            f"model{'s' * (len(models) > 1)}: give it once per model, in their order (the "
            "names given at once are one model's)"
        )
    return tuple(tuple(names) for names in given)
