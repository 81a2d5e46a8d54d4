"""The `vecpool` command line: one subparser and one `run_*` function per command (`embed`,
`serve`, `bench`), each returning the exit status."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

import vecpool
from vecpool.cli.bench import __doc__ as BENCH_DESCRIPTION
from vecpool.cli.bench import add_bench_arguments, run_bench
from vecpool.cli.common import CommandError, error_text
from vecpool.cli.embed import EMBED_EXAMPLES, EMBED_HELP, add_embed_arguments, run_embed
from vecpool.cli.serve import SERVE_DESCRIPTION, add_serve_arguments, serve
from vecpool.errors import EngineError, VecpoolError

if TYPE_CHECKING:  # `vecpool serve` runs no model in this process: torch loads where used
    from vecpool.api import Engine


def build_parser() -> argparse.ArgumentParser:
    """The `vecpool` argument parser, one subparser per command."""
    parser = argparse.ArgumentParser(
        prog="vecpool",
        description="vecpool: an inference engine for pooling models (embeddings and more).",
        epilog="Run `vecpool COMMAND --help` for the options of a command.",
    )
    parser.add_argument("--version", action="version", version=f"vecpool {vecpool.__version__}")
    commands = parser.add_subparsers(title="commands", dest="command", metavar="COMMAND")
    raw = argparse.RawDescriptionHelpFormatter  # descriptions laid out by hand, kept as written
    for name, help_text, description, epilog, formatter, add_arguments, run in (
        (
            "embed",
            "embed a file of texts or token ids (no input: example sentences)",
            EMBED_HELP,
            EMBED_EXAMPLES,
            raw,
            add_embed_arguments,
            run_embed,
        ),
        (
            "serve",
            "serve a model over HTTP (OpenAI, Cohere and Jina conventions)",
            SERVE_DESCRIPTION,
            None,
            raw,
            add_serve_arguments,
            run_serve,
        ),
        (
            "bench",
            "measure a model's throughput on synthetic texts",
            BENCH_DESCRIPTION,
            None,
            argparse.HelpFormatter,
            add_bench_arguments,
            run_bench,
        ),
    ):
        command = commands.add_parser(
            name,
            help=help_text,
            description=description,
            epilog=epilog,
            formatter_class=formatter,
        )
        add_arguments(command)
        command.set_defaults(run=run)
    return parser


def main(argv: list[str] | None = None, *, engine: Engine | None = None) -> int:
    """Run the `vecpool` command line on `argv` (default: `sys.argv[1:]`); return the exit status.

    `engine`, when given, serves the command in place of one loaded from MODEL and the engine
    options (for tests, and for programs that already hold an engine).
    """
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help, --version, or a usage error argparse has reported
        return int(exc.code or 0)
    if args.command is None:
        parser.print_help(sys.stderr)
        return 2
    try:
        return int(args.run(args, engine))
    except KeyboardInterrupt:
        return 130
    except EngineError as exc:  # the engine failed, not the user's input
        print(f"vecpool: error: {exc}", file=sys.stderr)
        return 1
    except (CommandError, VecpoolError) as exc:
        print(f"vecpool: error: {error_text(exc, args)}", file=sys.stderr)
        return 2


def run_serve(args: argparse.Namespace, engine: Engine | None) -> int:
    """`vecpool serve`: the HTTP server, until interrupted."""
    if engine is not None:
        raise CommandError("vecpool serve loads its own engine")
    return serve(args)
