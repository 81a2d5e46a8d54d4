"""`vecpool serve`: the command line of the HTTP server.

`add_serve_arguments(parser)` adds the options to any parser (the `vecpool serve` subcommand,
`python -m vecpool.server`); `serve(args)` loads the engine and runs uvicorn until stopped.
Nothing of the `server` extra is imported until `serve` runs.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from vecpool.api import DEFAULT_MODEL_PACKAGE
from vecpool.config import LLMRerankerConfig
from vecpool.errors import VecpoolError
from vecpool.task_calls import SCORE_MODES

DEFAULT_BATCH_INPUTS = 2048
SERVE_DESCRIPTION = """\
Serve a pooling model over HTTP: OpenAI /v1/embeddings, /pooling, /rerank (Cohere, Jina),
/score, /classify, /tokenize, /detokenize, /v1/models, /health, /metrics (Prometheus).
"""


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the `serve` options to `parser`."""
    default = DEFAULT_MODEL_PACKAGE.replace("_", "-")
    parser.add_argument(
        "model", nargs="?", metavar="MODEL", help=f"model folder (default: {default})"
    )
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
    limits.add_argument(
        "--enable-prompt-embeds",
        action="store_true",
        help='accept {"prompt_embeds": "<base64>"} inputs (off by default)',
    )
    eng = parser.add_argument_group("engine")
    eng.add_argument("--device", help="cpu, cuda, cuda:1, ... (default: cuda if available)")
    eng.add_argument("--dtype", help="float32, float16 or bfloat16 (default: float32 on cpu)")
    eng.add_argument("--max-model-len", type=int, metavar="N", help="max tokens per input")
    eng.add_argument(
        "--max-num-batched-tokens", type=int, metavar="N", help="token budget of one engine step"
    )
    eng.add_argument(
        "--max-num-seqs",
        type=int,
        metavar="N",
        help="inputs per engine step (default: 1024 on CUDA, 256 on the CPU)",
    )
    eng.add_argument(
        "--pooling",
        help="override the model's pooling: CLS, MEAN, LAST, MAX, MEAN_SQRT_LEN, WEIGHTED_MEAN",
    )
    eng.add_argument(
        "--normalize",
        action=argparse.BooleanOptionalAction,
        help="L2-normalize by default (default: as the model does)",
    )
    eng.add_argument(
        "--score-mode",
        choices=SCORE_MODES,
        help="how /score and /rerank compare texts (default: from the model)",
    )
    eng.add_argument(
        "--llm-reranker",
        choices=("qwen3",),
        help="serve a causal LM as a reranker with this prompt template (e.g. Qwen3-Reranker)",
    )
    eng.add_argument(
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

    default_name = DEFAULT_MODEL_PACKAGE.replace("_", "-")
    try:
        config = ServerConfig(  # checked before the model loads: fail fast
            model_names=tuple(
                args.served_model_name
                or [default_name if args.model is None else Path(args.model).resolve().name]
            ),
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
        engine = Engine(
            args.model,
            device=args.device,
            dtype=args.dtype,
            max_model_len=args.max_model_len,
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_num_seqs=args.max_num_seqs,
            pooling=args.pooling,
            normalize=args.normalize,
            enable_prompt_embeds=args.enable_prompt_embeds,
            score_mode=args.score_mode,
            llm_reranker=LLMRerankerConfig.qwen3() if args.llm_reranker == "qwen3" else None,
        )
    except VecpoolError as exc:
        print(f"vecpool serve: {exc}", file=sys.stderr)
        return 2
    app = create_app(engine, config)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    return 0
