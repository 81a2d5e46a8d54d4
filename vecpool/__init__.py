"""vecpool: an inference engine for pooling models (embeddings, scores, token vectors)."""

from vecpool.api import Engine, EngineArgs, EngineInfo, PoolingOutput, PreparedCall
from vecpool.config import LLMRerankerConfig
from vecpool.errors import (
    ConfigError,
    EngineError,
    InputError,
    ModelLoadError,
    RequestFailedError,
    VecpoolError,
)
from vecpool.inputs import TextOptions
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
