"""What the commands share."""

from __future__ import annotations

import argparse
import re

from vecpool.errors import ConfigError


class CommandError(Exception):
    """A mistake in the command's input or options, reported in one line (exit status 2)."""


def error_text(exc: Exception, args: argparse.Namespace) -> str:
    """`exc`'s message in the command line's words. The engine's and server's option checks
    (`ConfigError`) name their fields; a command's user typed flags: each option's Python name
    in such a message (a snake_case word that is one of `args`' names, `max_input_chars`) is
    given as its flag (`--max-input-chars`)."""
    message = str(exc)
    if not isinstance(exc, ConfigError):
        return message
    names = {name for name in vars(args) if "_" in name}
    return _SNAKE.sub(lambda m: "--" + m[0].replace("_", "-") if m[0] in names else m[0], message)


# A snake_case word, not inside a longer name or a flag already.
_SNAKE = re.compile(r"(?<![\w-])[a-z][a-z0-9]*(?:_[a-z0-9]+)+(?![\w-])")
