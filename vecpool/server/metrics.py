"""Prometheus metrics of one server, in a registry of its own (no global state).

HTTP: requests by endpoint and status, latency. Per request: seconds spent in the queue, in
tokenization (input processing, prompt-embeds decoding included) and in inference. Engine:
queue size, steps, tokens per step (batch tokens), request outcomes (finished, failed, and
cancelled: dropped because the client went away).
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from vecpool.engine.request import Request, RequestStatus

_SECONDS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
_TOKENS = tuple(float(2**i) for i in range(4, 18))


class ServerMetrics:
    def __init__(self, queue_size: Callable[[], float]):
        self.registry = CollectorRegistry()
        r = self.registry
        self.http_requests = Counter(
            "vecpool_http_requests", "HTTP requests answered", ["endpoint", "status"], registry=r
        )
        self.http_seconds = Histogram(
            "vecpool_http_request_seconds",
            "HTTP request latency, end to end",
            ["endpoint"],
            buckets=_SECONDS,
            registry=r,
        )
        self.queue_seconds = Histogram(
            "vecpool_request_queue_seconds",
            "Seconds a request's inputs waited for their first engine step",
            ["endpoint"],
            buckets=_SECONDS,
            registry=r,
        )
        self.tokenization_seconds = Histogram(
            "vecpool_request_tokenization_seconds",
            "Seconds spent validating, tokenizing and decoding a request's inputs",
            ["endpoint"],
            buckets=_SECONDS,
            registry=r,
        )
        self.inference_seconds = Histogram(
            "vecpool_request_inference_seconds",
            "Seconds from a request's first engine step to its last output",
            ["endpoint"],
            buckets=_SECONDS,
            registry=r,
        )
        self.prompt_tokens = Counter(
            "vecpool_prompt_tokens", "Prompt tokens of answered requests", ["endpoint"], registry=r
        )
        self.disconnects = Counter(
            "vecpool_client_disconnects",
            "Requests whose client went away before the answer; their work was cancelled",
            ["endpoint"],
            registry=r,
        )
        queued = Gauge("vecpool_queue_size", "Inputs queued or running in the engine", registry=r)
        queued.set_function(queue_size)
        self.engine_steps = Counter("vecpool_engine_steps", "Engine steps run", registry=r)
        self.step_seconds = Histogram(
            "vecpool_engine_step_seconds",
            "Duration of one engine step",
            buckets=_SECONDS,
            registry=r,
        )
        self.batch_tokens = Histogram(
            "vecpool_batch_tokens",
            "Prompt tokens completed per engine step",
            buckets=_TOKENS,
            registry=r,
        )
        self.engine_requests = Counter(
            "vecpool_engine_requests",
            "Engine requests (one per input) by outcome: finished, failed, cancelled",
            ["outcome"],
            registry=r,
        )
        self._step_tokens = 0  # written by the engine loop thread only

    def on_request_done(self, request: Request) -> None:
        """A request's done callback: runs in the loop thread, or where it was cancelled."""
        self.engine_requests.labels(request.status.value).inc()
        if request.status in (RequestStatus.FINISHED, RequestStatus.FAILED):
            self._step_tokens += request.num_prompt_tokens

    def on_step(self, started: float, ended: float) -> None:
        """The `AsyncEngine` step hook (loop thread): after the step's done callbacks ran."""
        self.engine_steps.inc()
        self.step_seconds.observe(ended - started)
        self.batch_tokens.observe(self._step_tokens)
        self._step_tokens = 0

    def render(self) -> bytes:
        return generate_latest(self.registry)
