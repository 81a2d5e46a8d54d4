"""The offline face of vecpool: `Engine` (`engine.py`; built by `build.py`), the options that
build it (`args.py`), and the asyncio front servers use (`async_engine.py`). Calls are prepared
by the model-free `vecpool.calls` (re-exported here: `CallContext`, `EngineInfo`, the outputs).

`Engine`, `default_model_path` and `outcome` load on first use (they import torch), so that
`EngineArgs` can be read where no model runs (the server's launcher). Everything a user
imported from `vecpool.api` is re-exported here."""

from typing import TYPE_CHECKING, Any

from vecpool.api.args import DEFAULT_MODEL_PACKAGE, SCORE_MODES, EngineArgs, Replica
from vecpool.calls import CallContext, EngineInfo, PoolingOutput, PreparedCall, PromptRequest
from vecpool.calls.outputs import output_data

if TYPE_CHECKING:
    from vecpool.api.engine import Engine, default_model_path
    from vecpool.api.outputs import outcome

_LAZY = {
    "Engine": "vecpool.api.engine",
    "default_model_path": "vecpool.api.engine",
    "outcome": "vecpool.api.outputs",
}


def __getattr__(name: str) -> Any:
    import importlib

    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    try:  # a submodule, as `import vecpool.api` once made every one an attribute
        return importlib.import_module(f"{__name__}.{name}")
    except ModuleNotFoundError as exc:
        if exc.name != f"{__name__}.{name}":
            raise  # it exists, and needs what is not installed
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None


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
