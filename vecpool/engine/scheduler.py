"""The scheduler: plain CPU Python that decides what runs in the next step.

It fills a token budget (`max_num_batched_tokens`) and a request cap (`max_num_seqs`) from the
waiting queue, first come first served, and says how many tokens of each request run.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from vecpool.config import SchedulerConfig
from vecpool.engine.request import Request, RequestStatus
from vecpool.runner.step import ScheduledChunk, StepInput


@dataclass(frozen=True)
class SchedulerOutput:
    """What runs in one engine step: the runners' view (`step`) and the requests it serves."""

    requests: list[Request] = field(default_factory=list)  # [num_seqs], in batch order
    step: StepInput = field(default_factory=StepInput)  # plain data for the runners

    @property
    def is_empty(self) -> bool:
        return not self.requests

    def part(self, start: int, end: int) -> SchedulerOutput:
        """Requests `start:end` of this step, as a step of their own."""
        return SchedulerOutput(self.requests[start:end], StepInput(self.step.chunks[start:end]))


class Scheduler:
    """Fills each step from the waiting queue, first come first served, under the token
    budget and the request cap of `SchedulerConfig`. Plain CPU Python: it never touches
    tensors."""

    def __init__(self, config: SchedulerConfig):
        self.config = config
        self.waiting: deque[Request] = deque()

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def has_work(self) -> bool:
        return bool(self.waiting)

    def schedule(self) -> SchedulerOutput:
        """Take whole prompts from the head of the queue while they fit the budget."""
        budget = self.config.max_num_batched_tokens
        requests: list[Request] = []
        chunks: list[ScheduledChunk] = []
        while self.waiting and len(chunks) < self.config.max_num_seqs:
            request = self.waiting[0]
            if request.is_done:  # cancelled while waiting
                self.waiting.popleft()
                continue
            if request.num_remaining_tokens > budget:
                break
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            requests.append(request)
            chunks.append(
                ScheduledChunk(
                    request.request_id,
                    request.prompt,
                    request.params,
                    request.task,
                    request.num_computed_tokens,
                    request.num_remaining_tokens,
                )
            )
            budget -= request.num_remaining_tokens
        return SchedulerOutput(requests, StepInput(chunks))
