"""Data parallel on the API side: one `EngineProcessClient` per engine process, each call sent
whole to the live engine with the fewest queued tokens.

An engine's queued tokens are the prompt tokens of the calls this API process has sent it and
not yet had answered: a call's cost is its tokens, not its count (one call of 32 passages
weighs what 500 single queries weigh). Each API process balances its own calls by what it
sent; every one of them spreading its share evenly spreads the whole. Ties go round robin.

An engine process that exits fails its own calls in flight at once (`EngineDeadError`, seen on
its pipe) and is sent no new ones; the others go on serving. `is_running` while any engine
runs; `health_problem` names the engines gone (`/health` then answers 503). The supervisor
restarts a lost engine process and hands it over (`served.ServedModelsClient` reads the
hand-overs: `EngineProcessClient.restarted`); that engine then takes calls again. While none
runs, new calls are refused with `retry_after`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

from vecpool.calls.outputs import PoolingOutput, PromptRequest, RunTimes
from vecpool.errors import EngineDeadError
from vecpool.server.engine_client import EngineProcessClient
from vecpool.server.metrics import EngineGroupMetrics

logger = logging.getLogger(__name__)
# Seconds a call refused while every engine process restarts is told to wait (Retry-After).
RESTART_RETRY_AFTER = 1.0


class EngineGroupClient:
    """Runs each call on one engine of `engines` (indexed by rank). `start()` inside the
    event loop that will use it; `close()` at exit."""

    def __init__(
        self,
        engines: Sequence[EngineProcessClient],
        metrics: EngineGroupMetrics | None = None,
    ):
        if not engines:
            raise ValueError("an engine group needs at least one engine")
        self.engines = list(engines)
        self.max_queued = sum(e.max_queued for e in self.engines)
        self.metrics = metrics
        self.queued_tokens = [0] * len(self.engines)  # by rank: sent, not yet answered
        self._next = 0  # where the search for the least loaded engine starts (round robin)

    async def start(self) -> None:
        for engine in self.engines:
            await engine.start()

    async def close(self) -> None:
        for engine in self.engines:
            await engine.close()

    @property
    def num_queued(self) -> int:
        return sum(e.num_queued for e in self.engines if e.is_running)

    @property
    def expected_wait(self) -> float:
        """The least loaded live engine's queued seconds: where a new call would go."""
        waits = [e.expected_wait for e in self.engines if e.is_running]
        return min(waits) if waits else 0.0

    @property
    def is_running(self) -> bool:
        return any(e.is_running for e in self.engines)

    @property
    def retry_after(self) -> float | None:
        """Seconds a refused call should wait while no engine runs (each lost one restarts,
        or the server stops); None while any runs."""
        return None if self.is_running else RESTART_RETRY_AFTER

    @property
    def health_problem(self) -> str | None:
        problems = [p for e in self.engines if (p := e.health_problem) is not None]
        if not problems:
            return None
        live = sum(e.is_running for e in self.engines)
        return f"{'; '.join(problems)} ({live} of {len(self.engines)} engine processes serve)"

    async def health(self) -> str | None:
        """`health_problem`, with each engine asked where it has said nothing lately
        (`EngineProcessClient.health`): a stuck engine fails the check as a gone one does."""
        answers = await asyncio.gather(*(e.health() for e in self.engines))
        problems = [p for p in answers if p is not None]
        if not problems:
            return None
        serving = len(self.engines) - len(problems)
        return f"{'; '.join(problems)} ({serving} of {len(self.engines)} engine processes serve)"

    def pick(self) -> int:
        """The rank of the live engine with the fewest queued tokens; among equals, the first
        from where the last pick left off. `EngineDeadError` when none runs."""
        n = len(self.engines)
        best = -1
        for k in range(n):
            rank = (self._next + k) % n
            if not self.engines[rank].is_running:
                continue
            if best < 0 or self.queued_tokens[rank] < self.queued_tokens[best]:
                best = rank
        if best < 0:
            raise EngineDeadError("every engine process has exited; restarting")
        self._next = (best + 1) % n
        return best

    async def run(
        self, requests: Sequence[PromptRequest], times: RunTimes | None = None
    ) -> list[PoolingOutput]:
        """Run `requests` (one call, never split) on the least loaded live engine; their
        outputs in order. Raises as `EngineProcessClient.run` does."""
        tokens = sum(r.prompt.num_tokens for r in requests)
        rank = self.pick()
        self._add(rank, tokens)
        try:
            outputs = await self.engines[rank].run(requests, times)
        finally:
            self._add(rank, -tokens)
        if self.metrics is not None:
            self.metrics.answered_tokens(rank).inc(tokens)
        return outputs

    def _add(self, rank: int, tokens: int) -> None:
        self.queued_tokens[rank] += tokens
        if self.metrics is not None:
            self.metrics.queued_tokens(rank).set(self.queued_tokens[rank])
