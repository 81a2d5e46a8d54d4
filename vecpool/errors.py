"""Exceptions a user of vecpool can meet.

`InputError` is the one to catch around a call: it is a `ValueError`, and it names the input
(its index in the call) and the reason. The engine that raised it stays usable.
"""

from __future__ import annotations


class VecpoolError(Exception):
    """Base class of every vecpool exception."""


class ConfigError(VecpoolError, ValueError):
    """An engine, model or scheduler setting is invalid or unsupported."""


class ModelLoadError(VecpoolError, ValueError):
    """A model folder is missing a file, or its weights do not match the architecture."""


class InputError(VecpoolError, ValueError):
    """One input of a call cannot be served; `index` says which, `reason` why."""

    def __init__(self, reason: str, index: int | None = None, field: str | None = None):
        self.reason = reason
        self.index = index
        self.field = field
        where = "" if index is None else f"input {index}"
        if field:
            where = f"{where} ({field})" if where else field
        super().__init__(f"{where}: {reason}" if where else reason)

    def at(self, index: int) -> InputError:
        """The same error, attributed to input `index` of the caller's call."""
        return type(self)(self.reason, index=index, field=self.field)


def check_flag(value: object, name: str) -> None:
    """`InputError` naming option `name` unless `value` is true or false (not a value read
    by its truthiness)."""
    if not isinstance(value, bool):
        raise InputError(f"must be true or false, got {value!r}", field=name)


class InputTooLongError(InputError):
    """An input over a length limit (the model's tokens, or the characters per input): the
    refusal some APIs answer with their own status (422, 413), and clients match on."""


class RequestFailedError(InputError):
    """An input was accepted but failed while the engine ran it (e.g. a task needed token ids)."""


class EngineError(VecpoolError, RuntimeError):
    """The engine itself failed (not the fault of one input)."""


class QueueFullError(VecpoolError):
    """The engine's queue cannot take the call (`max_queued` inputs, or `max_wait` seconds of
    work ahead of it); try again later."""


class EngineDeadError(EngineError):
    """The engine stopped (its process exited): nothing more will run."""
