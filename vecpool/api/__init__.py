"""The offline face of vecpool: `Engine` (one file, `engine.py`), the options that build it
(`args.py`), what a call returns (`outputs.py`) and the asyncio front servers use
(`async_engine.py`). Everything a user imported from `vecpool.api` is re-exported here."""

from vecpool.api.args import DEFAULT_MODEL_PACKAGE, SCORE_MODES, EngineArgs
from vecpool.api.engine import Engine, default_model_path
from vecpool.api.outputs import PoolingOutput, PreparedCall, outcome, output_data

__all__ = [
    "DEFAULT_MODEL_PACKAGE",
    "SCORE_MODES",
    "Engine",
    "EngineArgs",
    "PoolingOutput",
    "PreparedCall",
    "default_model_path",
    "outcome",
    "output_data",
]
