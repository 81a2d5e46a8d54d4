"""The offline face of vecpool: `Engine` (one file, `engine.py`), the task calls as functions
over a `CallContext` (`calls.py`), their pure post-processing (`postprocess.py`), what the
engine serves (`info.py`), the options that build it (`args.py`), what a call sends and returns
(`outputs.py`) and the asyncio front servers use (`async_engine.py`). Everything a user
imported from `vecpool.api` is re-exported here."""

from vecpool.api.args import DEFAULT_MODEL_PACKAGE, SCORE_MODES, EngineArgs, Replica
from vecpool.api.calls import CallContext
from vecpool.api.engine import Engine, default_model_path
from vecpool.api.info import EngineInfo
from vecpool.api.outputs import (
    PoolingOutput,
    PreparedCall,
    PromptRequest,
    outcome,
    output_data,
)

__all__ = [
    "DEFAULT_MODEL_PACKAGE",
    "SCORE_MODES",
    "CallContext",
    "Engine",
    "EngineArgs",
    "EngineInfo",
    "PoolingOutput",
    "PreparedCall",
    "PromptRequest",
    "Replica",
    "default_model_path",
    "outcome",
    "output_data",
]
