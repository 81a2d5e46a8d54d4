"""`python -m vecpool.server [MODEL] [options]`: the same as `vecpool serve`."""

from __future__ import annotations

import argparse
import sys

from vecpool.server.cli import SERVE_DESCRIPTION, add_serve_arguments, serve


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m vecpool.server", description=SERVE_DESCRIPTION)
    add_serve_arguments(parser)
    return serve(parser.parse_args())


if __name__ == "__main__":
    sys.exit(main())
