"""Ray Serve: the vecpool HTTP API (the same FastAPI app as `vecpool serve`) as a deployment of N
replicas, fixed or autoscaled, each holding one engine. Clients (the OpenAI client included)
talk to Serve's HTTP proxy as they would to `vecpool serve`.

    serve run vecpool.integrations.ray_serve:app                   # default model, 1 replica
    serve run vecpool.integrations.ray_serve:build_app model=/models/bge num_replicas=4 num_gpus=1
    serve run vecpool.integrations.ray_serve:build_app model=/models/bge num_replicas=auto \\
        min_replicas=1 max_replicas=8 target_ongoing_requests=64 num_gpus=1

From Python: `serve.run(build_app({...}))`, or `VecpoolDeployment.options(...).bind(engine_args,
server_config)` for full control.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ray import serve
from ray.serve import Application

from vecpool.api import Engine, EngineArgs
from vecpool.server.app import create_app
from vecpool.server.config import ServerConfig

# Requests one replica takes at once: the engine batches across them, so this is far above
# Serve's default; beyond it the server's own queue answers 429.
DEFAULT_MAX_ONGOING_REQUESTS = 256

# `serve run ...:build_app KEY=VALUE` keys, with how each value is read.
_ENGINE_KEYS: dict[str, Callable[[str], Any]] = {
    "model": str,
    "device": str,
    "dtype": str,
    "max_model_len": int,
    "max_num_batched_tokens": int,
    "max_num_seqs": int,
    "pooling": str,
    "enable_prompt_embeds": lambda v: v.lower() in ("1", "true", "yes"),
}
_SERVER_KEYS: dict[str, Callable[[str], Any]] = {
    "served_model_name": str,
    "api_key": str,
    "max_queued": int,
}
_DEPLOYMENT_KEYS: dict[str, Callable[[str], Any]] = {
    "num_replicas": str,  # an integer, or "auto"
    "min_replicas": int,
    "max_replicas": int,
    "target_ongoing_requests": float,
    "max_ongoing_requests": int,
    "num_cpus": float,
    "num_gpus": float,
    "name": str,
}


@serve.deployment(max_ongoing_requests=DEFAULT_MAX_ONGOING_REQUESTS)
@serve.ingress()
class VecpoolDeployment:
    """One replica: an engine and the vecpool HTTP app around it."""

    def __init__(self, engine_args: EngineArgs | None = None, config: ServerConfig | None = None):
        engine_args = engine_args or EngineArgs()
        self.engine = Engine.from_args(engine_args)
        self.config = config or ServerConfig(model_names=(engine_args.model_name,))

    def __serve_build_asgi_app__(self) -> Any:
        """The app Serve runs in this replica (its startup starts the engine loop)."""
        return create_app(self.engine, self.config)


def build_app(args: dict[str, str]) -> Application:
    """The deployment, from `serve run` arguments (strings): the engine's (`model`, `device`,
    `dtype`, `max_model_len`, ...), the server's (`served_model_name`, `api_key`,
    `max_queued`), and the deployment's: `num_replicas` (a number, or `auto`),
    `min_replicas` / `max_replicas` / `target_ongoing_requests` (autoscaling),
    `max_ongoing_requests`, `num_cpus` / `num_gpus` per replica, `name`."""
    known = _ENGINE_KEYS | _SERVER_KEYS | _DEPLOYMENT_KEYS
    unknown = sorted(set(args) - set(known))
    if unknown:
        raise ValueError(f"unknown argument(s) {unknown}; known: {sorted(known)}")
    values = {key: known[key](value) for key, value in args.items()}
    engine_args = EngineArgs(**{k: v for k, v in values.items() if k in _ENGINE_KEYS})
    server: dict[str, Any] = {k: v for k, v in values.items() if k in _SERVER_KEYS}
    names = server.pop("served_model_name", None)
    config = ServerConfig(
        model_names=tuple(names.split(",")) if names else (engine_args.model_name,), **server
    )
    deployment: Any = VecpoolDeployment  # a serve.Deployment, whatever its type says
    return deployment.options(**deployment_options(values)).bind(engine_args, config)


def deployment_options(values: dict[str, Any]) -> dict[str, Any]:
    """`Deployment.options(...)` for the deployment keys among `values` (typed)."""
    options: dict[str, Any] = {}
    actor = {k: values[k] for k in ("num_cpus", "num_gpus") if k in values}
    if actor:
        options["ray_actor_options"] = actor
    for key in ("max_ongoing_requests", "name"):
        if key in values:
            options[key] = values[key]
    autoscaling = {
        k: values[k]
        for k in ("min_replicas", "max_replicas", "target_ongoing_requests")
        if k in values
    }
    replicas = values.get("num_replicas")
    if replicas == "auto" or (autoscaling and replicas is None):
        options["autoscaling_config"] = autoscaling
    elif autoscaling:
        raise ValueError(
            "min_replicas / max_replicas / target_ongoing_requests need num_replicas=auto"
        )
    elif replicas is not None:
        options["num_replicas"] = int(replicas)
    return options


# `serve run vecpool.integrations.ray_serve:app`: the default model, one replica.
app = build_app({})
