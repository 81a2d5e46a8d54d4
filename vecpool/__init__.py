"""vecpool: an inference engine for pooling models (embeddings, scores, token vectors).

`Engine` and `EngineArgs` load on first use (they import torch); the rest is model-free, so a
process that only prepares calls (the server's API processes) never loads torch."""

from typing import TYPE_CHECKING, Any

from vecpool.calls import EngineInfo, PoolingOutput, PreparedCall
from vecpool.config import LLMRerankerConfig
from vecpool.errors import (
    ConfigError,
    EngineError,
    InputError,
    ModelLoadError,
    RequestFailedError,
    VecpoolError,
)
from vecpool.inputs.prompts import TextOptions
from vecpool.tasks import TASKS, PoolingParams

__all__ = [
    "TASKS",
    "ConfigError",
    "Engine",
    "EngineArgs",
    "EngineError",
    "EngineInfo",
    "InputError",
    "LLMRerankerConfig",
    "ModelLoadError",
    "PoolingOutput",
    "PoolingParams",
    "PreparedCall",
    "RequestFailedError",
    "TextOptions",
    "VecpoolError",
]
__version__ = "0.1.0"

if TYPE_CHECKING:
    from vecpool.api import Engine, EngineArgs


def __getattr__(name: str) -> Any:
    import importlib

    if name in ("Engine", "EngineArgs"):
        return getattr(importlib.import_module("vecpool.api"), name)
    try:  # a subpackage, as `import vecpool` once made `vecpool.api` an attribute
        return importlib.import_module(f"{__name__}.{name}")
    except ModuleNotFoundError as exc:
        if exc.name != f"{__name__}.{name}":
            raise  # it exists, and needs what is not installed
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
