"""Prometheus metrics of one server, in a registry of its own (no global state).

HTTP (`ServerMetrics`, in each API process): requests by endpoint and status, latency; per
request, seconds spent in tokenization (input processing, prompt-embeds decoding included), in
the queue and in inference. Engine (`EngineMetrics`, where the engine runs): queue size, steps,
tokens per step (batch tokens), request outcomes (finished, failed, and cancelled: dropped
because the client went away), prompt tokens the shared-prefix cache was queried for and hit.
The supervisor (`SupervisorMetrics`): engine processes restarted.

With several models served, every engine's metric (the engine process's, and those labelled
`engine`) carries a `model` label too: the model's served name. With one model it has none, so
a single-model server's metrics read as they always have.

With several processes, each records into prometheus-client's multiprocess directory (the
`PROMETHEUS_MULTIPROC_DIR` the launcher sets for them) and `/metrics`, answered by any API
process, sums them all.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.multiprocess import MultiProcessCollector

if TYPE_CHECKING:  # types only: the API processes load nothing of the engine
    from vecpool.api.admission import Admission
    from vecpool.engine.core import EngineCore
    from vecpool.engine.request import Request

_SECONDS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
_TOKENS = tuple(float(2**i) for i in range(4, 18))


def _model_label(model: str | None) -> tuple[str, ...]:
    """The `model` label's values: none with one model served (`model` None)."""
    return () if model is None else (model,)


def _names(model: str | None, *names: str) -> list[str]:
    """Label names: `names`, then `model` where several models are served."""
    return [*names, *(("model",) if model is not None else ())]


M = TypeVar("M", Counter, Gauge, Histogram)


def _bound(metric: M, model: tuple[str, ...]) -> M:
    """`metric` with its `model` label set, where it has one."""
    return metric.labels(*model) if model else metric


@dataclass(frozen=True)
class EndpointMetrics:
    """An endpoint's metrics with its label set."""

    http_seconds: Histogram
    tokenization_seconds: Histogram
    queue_seconds: Histogram
    inference_seconds: Histogram
    prompt_tokens: Counter


class ServerMetrics:
    """The HTTP side's metrics, and (one process) the engine's, in one registry.

    `engine_queue_size` (one process): the engine's queue size, read at each scrape; the
    engine's metrics are then recorded here too (`self.engine`). `multiprocess_dir`: render
    the sum of every process's metrics in that directory."""

    def __init__(
        self,
        engine_queue_size: Callable[[], float] | None = None,
        *,
        multiprocess_dir: str | None = None,
    ):
        self.registry = CollectorRegistry()
        self.multiprocess_dir = multiprocess_dir
        r = self.registry
        self.http_requests = Counter(
            "vecpool_http_requests", "HTTP requests answered", ["endpoint", "status"], registry=r
        )
        # fmt: off
        self.http_seconds, self.queue_seconds, self.tokenization_seconds, self.inference_seconds = (
            Histogram(name, text, ["endpoint"], buckets=_SECONDS, registry=r)
            for name, text in (
                ("vecpool_http_request_seconds", "HTTP request latency, end to end"),
                ("vecpool_request_queue_seconds", "Seconds a request's inputs waited for their first engine step"),
                ("vecpool_request_tokenization_seconds", "Seconds spent validating, tokenizing and decoding a request's inputs"),
                ("vecpool_request_inference_seconds", "Seconds from a request's first engine step to its last output"),
            )
        )
        # fmt: on
        self.prompt_tokens = Counter(
            "vecpool_prompt_tokens", "Prompt tokens of answered requests", ["endpoint"], registry=r
        )
        self.disconnects = Counter(
            "vecpool_client_disconnects",
            "Requests whose client went away before the answer; their work was cancelled",
            ["endpoint"],
            registry=r,
        )
        self.engine = (
            EngineMetrics(self.registry, engine_queue_size)
            if engine_queue_size is not None
            else None
        )
        self._endpoints: dict[str, EndpointMetrics] = {}
        self._answers: dict[tuple[str, int], Counter] = {}

    def for_endpoint(self, endpoint: str) -> EndpointMetrics:
        """The metrics of one endpoint (a route's path, or "other"), their labels bound once:
        binding them per request was a few percent of an API process's CPU."""
        bound = self._endpoints.get(endpoint)
        if bound is None:
            bound = self._endpoints[endpoint] = EndpointMetrics(
                http_seconds=self.http_seconds.labels(endpoint),
                tokenization_seconds=self.tokenization_seconds.labels(endpoint),
                queue_seconds=self.queue_seconds.labels(endpoint),
                inference_seconds=self.inference_seconds.labels(endpoint),
                prompt_tokens=self.prompt_tokens.labels(endpoint),
            )
        return bound

    def answered(self, endpoint: str, status: int) -> Counter:
        """The count of `endpoint`'s answers of `status`."""
        counter = self._answers.get((endpoint, status))
        if counter is None:
            counter = self.http_requests.labels(endpoint, str(status))
            self._answers[endpoint, status] = counter
        return counter

    def render(self) -> bytes:
        if self.multiprocess_dir is None:
            return generate_latest(self.registry)
        registry = CollectorRegistry()
        MultiProcessCollector(registry, self.multiprocess_dir)
        return generate_latest(registry)


class EngineMetrics:
    """The engine's metrics, recorded by whatever runs its loop (the in-process front's
    hooks, or the engine process). `queue_size`: read at each scrape; without it, the loop
    sets the gauge itself (`set_queue_size`). `model`: the served name its metrics are
    labelled with where several models are served (None: one model, no label)."""

    def __init__(
        self,
        registry: CollectorRegistry,
        queue_size: Callable[[], float] | None = None,
        *,
        model: str | None = None,
    ):
        r = registry
        by_model = _names(model)
        self._model = _model_label(model)
        queue = Gauge(
            "vecpool_queue_size",
            "Inputs queued or running in the engine",
            by_model,
            multiprocess_mode="livesum",
            registry=r,
        )
        self.queue_size = _bound(queue, self._model)
        if queue_size is not None:
            self.queue_size.set_function(queue_size)
        # fmt: off
        # What admission by expected wait compares (`Admission`), as of the engine's last reply.
        self.expected_wait, self.measured_speed = (
            _bound(Gauge(name, text, by_model, multiprocess_mode="livemax", registry=r), self._model)
            for name, text in (
                ("vecpool_engine_expected_wait_seconds", "Seconds of work queued in the engine at its measured speed"),
                ("vecpool_engine_measured_tokens_per_second", "The engine's prompt tokens per second of stepping, as admission measures it"),
            )
        )
        steps = Counter("vecpool_engine_steps", "Engine steps run", by_model, registry=r)
        self.engine_steps = _bound(steps, self._model)
        self.step_seconds, self.batch_tokens = (
            _bound(Histogram(name, text, by_model, buckets=buckets, registry=r), self._model)
            for name, buckets, text in (
                ("vecpool_engine_step_seconds", _SECONDS, "Duration of one engine step"),
                ("vecpool_batch_tokens", _TOKENS, "Prompt tokens completed per engine step"),
            )
        )
        # fmt: on
        self.engine_requests = Counter(
            "vecpool_engine_requests",
            "Engine requests (one per input) by outcome: finished, failed, cancelled",
            _names(model, "outcome"),
            registry=r,
        )
        # fmt: off
        self.prefix_cache_hit_tokens, self.prefix_cache_queried_tokens = (
            Counter(name, text, registry=r)
            for name, text in (
                ("vecpool_prefix_cache_hit_tokens", "Prompt tokens served from the shared-prefix cache instead of computed"),
                ("vecpool_prefix_cache_queried_tokens", "Prompt tokens of the requests that looked the shared-prefix cache up"),
            )
        )
        # fmt: on
        # The engine's (hit, queried) totals, read after each step (`EngineCore`'s
        # `prefix_cache_stats`); None: no prefix cache to report.
        self.prefix_cache_stats: Callable[[], tuple[int, int]] | None = None
        self._prefix_cache_seen = (0, 0)
        self._step_tokens = 0  # written by the engine loop thread only
        self._by_outcome: dict[str, Counter] = {}  # `engine_requests` by outcome label

    def follow_prefix_cache(self, core: EngineCore) -> None:
        """Report `core`'s shared-prefix cache counters, where it has a cache (without one,
        nothing is read per request)."""
        if core.scheduler.prefix_cache is not None:
            self.prefix_cache_stats = lambda: core.prefix_cache_stats

    def on_request_done(self, request: Request) -> None:
        """A request's done callback: runs in the loop thread, or where it was cancelled."""
        outcome = request.status.value
        counter = self._by_outcome.get(outcome)
        if counter is None:  # `labels` takes a lock and a lookup: once per outcome
            counter = self._by_outcome[outcome] = self.engine_requests.labels(outcome, *self._model)
        counter.inc()
        if outcome in ("finished", "failed"):
            self._step_tokens += request.num_prompt_tokens
            self._sync_prefix_cache()  # the loop thread: before the answer goes out

    def on_step(self, started: float, ended: float) -> None:
        """After each step that ran a batch (loop thread), its done callbacks run."""
        self.engine_steps.inc()
        self.step_seconds.observe(ended - started)
        self.batch_tokens.observe(self._step_tokens)
        self._step_tokens = 0
        self._sync_prefix_cache()

    def _sync_prefix_cache(self) -> None:
        """Bring the prefix cache counters to the engine's totals (loop thread only)."""
        if self.prefix_cache_stats is None:
            return
        (hit, queried), (seen_hit, seen_queried) = (
            self.prefix_cache_stats(),
            self._prefix_cache_seen,
        )
        if (hit, queried) != (seen_hit, seen_queried):
            self.prefix_cache_hit_tokens.inc(hit - seen_hit)
            self.prefix_cache_queried_tokens.inc(queried - seen_queried)
            self._prefix_cache_seen = (hit, queried)

    def set_queue_size(self, n: int) -> None:
        self.queue_size.set(n)

    def set_admission(self, wait: float, tokens_per_second: float | None) -> None:
        """The queue's expected wait and the measured speed it is reckoned at (the engine
        process, at each reply)."""
        self.expected_wait.set(wait)
        self.measured_speed.set(tokens_per_second or 0.0)

    def follow_admission(self, admission: Admission) -> None:
        """The same, read at each scrape (an engine in the app's own process)."""
        self.expected_wait.set_function(admission.expected_wait)
        self.measured_speed.set_function(lambda: admission.tokens_per_second or 0.0)


class EngineGroupMetrics:
    """An API process's view of each engine process of a data-parallel group (label
    `engine`: its rank; and `model`, the model's served name, where several are served),
    summed over the API processes: prompt tokens sent and not yet answered (what the balancer
    compares), and prompt tokens of the calls each answered."""

    def __init__(self, registry: CollectorRegistry | None, *, model: str | None = None):
        self._model = _model_label(model)
        self._queued_tokens = Gauge(
            "vecpool_engine_queued_tokens",
            "Prompt tokens of calls sent to an engine process and not yet answered",
            _names(model, "engine"),
            multiprocess_mode="livesum",
            registry=registry,
        )
        self._answered_tokens = Counter(
            "vecpool_engine_answered_tokens",
            "Prompt tokens of the calls an engine process answered",
            _names(model, "engine"),
            registry=registry,
        )

    def queued_tokens(self, rank: int) -> Gauge:
        return self._queued_tokens.labels(str(rank), *self._model)

    def answered_tokens(self, rank: int) -> Counter:
        return self._answered_tokens.labels(str(rank), *self._model)


class SupervisorMetrics:
    """The supervisor's: engine processes restarted, by rank (label `engine`) and, where
    several models are served, model (label `model`), each counted once it is back in
    service. `engines`: each engine's (model label or None, rank), shown from the start (at 0)."""

    def __init__(
        self, registry: CollectorRegistry | None, engines: Sequence[tuple[str | None, int]]
    ):
        several = any(model is not None for model, _ in engines)
        self._engine_restarts = Counter(
            "vecpool_engine_restarts",
            "Engine processes restarted after they were lost or exited at fault",
            ["engine", "model"] if several else ["engine"],
            registry=registry,
        )
        for model, rank in engines:
            self.engine_restarts(model, rank)

    def engine_restarts(self, model: str | None, rank: int) -> Counter:
        return self._engine_restarts.labels(str(rank), *_model_label(model))
