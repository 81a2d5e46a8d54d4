"""What the commands share."""

from __future__ import annotations


class CommandError(Exception):
    """A mistake in the command's input or options, reported in one line (exit status 2)."""
