"""What every endpoint shares: the engine it talks to, the settings, the metrics.

The server never reads an engine's internals: it knows the engine through its `EngineInfo`,
prepares calls with a `CallContext` (the functions of `vecpool.calls`), and runs their
requests on an `EngineClient` — the in-process `AsyncEngine`, or a client of an engine core in
another process.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Protocol

from starlette.requests import Request as HttpRequest

from vecpool.calls import CallContext, EngineInfo, PoolingOutput, PromptRequest
from vecpool.calls.outputs import RunTimes
from vecpool.server.config import ServerConfig
from vecpool.server.errors import ApiError
from vecpool.server.metrics import ServerMetrics
from vecpool.server.protocol import TextParams


class EngineClient(Protocol):
    """How the server runs requests: an engine front (`AsyncEngine`, or a core process's
    client). `run` raises `QueueFullError` when the queue cannot take the requests."""

    max_queued: int

    @property
    def num_queued(self) -> int: ...

    @property
    def expected_wait(self) -> float: ...  # seconds of queued work (the least loaded engine's)

    @property
    def is_running(self) -> bool: ...  # can take calls (with data parallel: any engine runs)

    @property
    def health_problem(self) -> str | None: ...  # why /health fails (any engine gone), or None

    @property
    def retry_after(self) -> float | None: ...  # no engine runs, one restarts: retry after this

    async def health(self) -> str | None: ...  # health_problem, or an engine that does not answer

    async def run(
        self, requests: Sequence[PromptRequest], times: RunTimes | None = None
    ) -> list[PoolingOutput]: ...


@dataclass
class ServerState:
    """The engine's description and input stage, its client (set at startup), the settings
    and the metrics.

    With several models served, the app's state is the first (default) model's, its client
    the server's as a whole (`served.ServedModelsClient`: calls on it run on the first model),
    and `models` maps every served name to its model's state (the first model's names to the
    app's state itself): each with that model's info, context, names (`config.model_names`) and
    engines' client, sharing the metrics and the input thread pool. Routes find the state of
    the model a call names with `for_model`."""

    info: EngineInfo
    context: CallContext
    config: ServerConfig
    metrics: ServerMetrics
    client: EngineClient | None = None  # set at startup
    executor: Executor | None = None  # decodes and tokenizes inputs; set at startup
    # Prepares the calls that read images (fetching, decoding, resizing); set at startup.
    media_executor: Executor | None = None
    created: int = field(default_factory=lambda: int(time.time()))
    # Every served name -> its model's state, where the server runs engine processes (set at
    # startup); empty for an engine in this process (one model: `check_model` decides).
    models: dict[str, ServerState] = field(default_factory=dict)
    # The client of this model's own engines where it is not `client`: the first model's,
    # whose `client` is the server's as a whole (running while any model's engine runs).
    model_client: EngineClient | None = None

    def for_model(self, name: str | None) -> ServerState:
        """The state of the model a call names in its `model` field: None names the first
        model (this state); a name not served is a 404."""
        if name is None:
            return self
        state = self.models.get(name)
        if state is None:
            self.check_model(name)  # one model, in this process: its names are the config's
            return self
        return state

    def each_model(self) -> list[ServerState]:
        """Every served model's state, once each, the first model's (this one) first."""
        states = [self]
        for state in self.models.values():
            if all(state is not seen for seen in states):
                states.append(state)
        return states

    def running_client(self) -> EngineClient:
        """The client of this model's engines while one runs, or a 503 naming what is lost
        (saying when to retry while its engine processes restart)."""
        return _running(self.model_client or self.client)

    async def check_health(self) -> None:
        """A 503 unless every engine runs and answers. With data parallel, one engine process
        gone or stuck fails the check, naming it, though the others still serve: a probe that
        sees the server whole restarts it and gets the lost engine back."""
        problem = await _running(self.client).health()
        if problem is not None:
            raise ApiError(503, problem, code="unavailable")

    def check_model(self, name: str | None) -> None:
        """A 404 unless `name` (when given) is one of the served models' names."""
        served = [n for names in self.config.served_model_names for n in names]
        if name is not None and name not in served and name not in self.models:
            shown = name if len(name) <= 100 else name[:100] + "..."  # as asked, not all of it
            raise ApiError(
                404,
                f"the model {shown!r} does not exist; this server serves "
                f"{', '.join(map(repr, served))}",
                param="model",
                code="model_not_found",
            )

    def check_count(self, n: int, list_name: str = "input") -> None:
        """A 400 for a list of inputs that is empty or longer than one request may hold."""
        if n == 0:
            raise ApiError(
                400, f"{list_name} is an empty list", param=list_name, code="invalid_input"
            )
        if n > self.config.max_batch_inputs:
            raise ApiError(
                400,
                f"{list_name} has {n} items, more than the limit of "
                f"{self.config.max_batch_inputs} per request",
                param=list_name,
                code="too_many_inputs",
            )

    def truncate(self, body: TextParams | None = None) -> int | None:
        """The call's truncate_prompt_tokens: as `body` asks, else (none asked, or no body)
        -1, the model's limit, under --auto-truncate, else None: the one place that reads it."""
        asked = None if body is None else body.truncate_prompt_tokens
        if asked is None and self.config.auto_truncate:
            return -1
        return asked


def get_state(request: HttpRequest) -> ServerState:
    state: ServerState = request.app.state.vecpool
    return state


def _running(client: EngineClient | None) -> EngineClient:
    if client is None or not client.is_running:
        problem = client.health_problem if client is not None else None
        raise unavailable(client, "the engine is not running" + (f": {problem}" if problem else ""))
    return client


def unavailable(client: EngineClient | None, message: str) -> ApiError:
    """A 503 saying `message`, and when to retry where `client`'s engines restart."""
    retry = client.retry_after if client is not None else None
    return ApiError(
        503,
        message,
        code="unavailable",
        headers={"retry-after": str(math.ceil(retry))} if retry is not None else None,
    )
