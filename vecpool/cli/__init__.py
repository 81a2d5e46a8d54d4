"""The `vecpool` command line: `main.py` (the parser and dispatch), one file per command
(`embed.py`, `serve.py`, `bench.py`). `vecpool.cli.main` is the console script."""

from vecpool.cli.main import build_parser, main

__all__ = ["build_parser", "main"]
