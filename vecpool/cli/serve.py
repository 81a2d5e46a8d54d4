"""`vecpool serve`: the command line of the HTTP server.

`add_serve_arguments(parser)` adds the options to a parser; `serve(args)` loads the engine and
runs uvicorn until stopped. Nothing of the `server` extra is imported until `serve` runs.
"""

from __future__ import annotations

import argparse
import sys

from vecpool.api import EngineArgs
from vecpool.errors import VecpoolError

DEFAULT_BATCH_INPUTS = 2048
SERVE_DESCRIPTION = """\
Serve a pooling model over HTTP: OpenAI /v1/embeddings, /pooling, /rerank (Cohere, Jina),
/score, /classify, /tokenize, /detokenize, /v1/models, /health, /metrics (Prometheus).
"""


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the `serve` options to `parser`."""
    # Prompt embeds arrive as base64 blobs from any client: refused unless asked for.
    EngineArgs.add_cli_args(parser, enable_prompt_embeds=False)
    http = parser.add_argument_group("HTTP")
    http.add_argument("--host", default="127.0.0.1", help="address to bind (default: %(default)s)")
    http.add_argument("--port", type=int, default=8000, help="port (default: %(default)s)")
    http.add_argument(
        "--served-model-name",
        nargs="+",
        metavar="NAME",
        help="model names clients may send; the first is reported (default: the folder name)",
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
        "--auto-truncate",
        action="store_true",
        help="truncate inputs longer than --max-model-len instead of refusing them",
    )
    http.add_argument(
        "--tokenizer-threads",
        type=int,
        default=4,
        metavar="N",
        help="threads that tokenize and validate inputs (default: %(default)s)",
    )


def serve(args: argparse.Namespace) -> int:
    """Load the engine and serve it until interrupted; the exit status."""
    try:
        import uvicorn

        from vecpool.server.app import create_app
    except ImportError as exc:
        print(
            f"vecpool serve: the server needs the `server` extra (pip install 'vecpool[server]'): {exc}",
            file=sys.stderr,
        )
        return 2
    from vecpool.api import Engine
    from vecpool.server.config import ServerConfig

    try:
        engine_args = EngineArgs.from_cli_args(args)
        config = ServerConfig(  # checked before the model loads: fail fast
            model_names=tuple(args.served_model_name or [engine_args.model_name]),
            api_key=args.api_key,
            max_queued=args.max_queued,
            max_batch_inputs=(
                args.max_batch_inputs
                if args.max_batch_inputs is not None
                else min(DEFAULT_BATCH_INPUTS, args.max_queued)
            ),
            max_payload_bytes=int(args.max_payload_mb * 2**20),
            auto_truncate=args.auto_truncate,
            tokenizer_threads=args.tokenizer_threads,
        )
        engine = Engine.from_args(engine_args)
    except VecpoolError as exc:
        print(f"vecpool serve: {exc}", file=sys.stderr)
        return 2
    app = create_app(engine, config)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    return 0
