"""Server settings: built once from the command line (or by hand), validated when built."""

from __future__ import annotations

from dataclasses import dataclass

from vecpool.errors import ConfigError

# Paths served without an API key: liveness probes (/ping: SageMaker's) and Prometheus scrapes.
PUBLIC_PATHS = frozenset({"/health", "/ping", "/metrics"})


@dataclass(frozen=True)
class ServerConfig:
    """What the HTTP layer enforces; the engine's own limits live in `Engine`."""

    model_names: tuple[str, ...]  # names accepted in `model`; the first is the one reported
    # With several models served (`vecpool serve A B`): each further model's names, in order.
    # A call naming none of the models' names is a 404; a call naming no model goes to the first.
    other_model_names: tuple[tuple[str, ...], ...] = ()
    api_key: str | None = None  # Bearer token every non-public path requires
    max_queued: int = 4096  # requests (inputs) waiting or running before 429
    max_batch_inputs: int = 2048  # inputs one HTTP request may hold
    max_payload_bytes: int = 32 * 2**20  # request body size before 413
    # Values a per-token answer (`/pooling`'s token_embed / token_classify, TEI's /embed_all)
    # may hold, counted before it runs: each input's tokens times a token's width.
    max_answer_values: int = 2**24
    auto_truncate: bool = False  # inputs over max_model_len are truncated instead of refused
    tokenizer_threads: int = 4
    # Seconds of work (queued tokens at the engine's measured tokens/s) ahead of a new request
    # before it gets 429: the bound on an admitted request's wait in the queue.
    max_queue_wait: float = 10.0
    read_timeout: float = 30.0  # seconds for a request's headers and body to arrive, else 408
    max_connections: int = 8192  # open connections per API process; past it, 503 and close

    def __post_init__(self) -> None:
        for names in self.served_model_names:
            if not names or any(not name for name in names):
                raise ConfigError("each served model needs at least one non-empty model name")
        every = [name for names in self.served_model_names for name in names]
        if len(set(every)) != len(every):
            twice = sorted({name for name in every if every.count(name) > 1})
            raise ConfigError(
                f"the served model name {twice[0]!r} is given twice; each model's names "
                "must be its own (--served-model-name, once per model)"
            )
        if self.api_key is not None and not self.api_key:
            raise ConfigError("--api-key must not be empty")
        for name in (
            "max_queued",
            "max_batch_inputs",
            "max_payload_bytes",
            "max_answer_values",
            "tokenizer_threads",
            "max_connections",
        ):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")
        for name in ("max_queue_wait", "read_timeout"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")
        if self.max_batch_inputs > self.max_queued:
            raise ConfigError(
                f"max_batch_inputs={self.max_batch_inputs} is above max_queued={self.max_queued}; "
                "a request that large could never be queued"
            )

    @property
    def model_name(self) -> str:
        return self.model_names[0]

    @property
    def served_model_names(self) -> tuple[tuple[str, ...], ...]:
        """Every served model's names, the default (first) model's first."""
        return (self.model_names, *self.other_model_names)


@dataclass(frozen=True)
class EngineProcessConfig:
    """How the engine process listens and batches."""

    address: str  # the ZeroMQ address it binds, e.g. "ipc:///tmp/.../engine"
    max_queued: int  # requests queued or running before a call is refused
    batch_wait: float  # seconds an idle engine waits for more requests before it steps
    max_wait: float | None = None  # seconds of work ahead of a call before it is refused
    metrics: bool = True  # record the engine's metrics (into the multiprocess directory)
    model: str | None = None  # its metrics' `model` label, where several models are served
