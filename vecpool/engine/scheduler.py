"""The scheduler: plain CPU Python that decides what runs in the next step.

It fills a token budget (`max_num_batched_tokens`) and a request cap (`max_num_seqs`) from the
waiting queue, first come first served, and says how many tokens of each request run.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from vecpool.config import SchedulerConfig
from vecpool.engine.request import Request, RequestStatus


@dataclass(slots=True)
class ScheduledChunk:
    """`num_tokens` tokens of `request`, starting at its `num_computed_tokens`."""

    request: Request
    start: int  # first prompt position run in this step
    num_tokens: int

    @property
    def is_last(self) -> bool:
        return self.start + self.num_tokens == self.request.num_prompt_tokens


@dataclass(frozen=True)
class SchedulerOutput:
    """What runs in one engine step."""

    chunks: list[ScheduledChunk] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)

    @property
    def is_empty(self) -> bool:
        return not self.chunks


class Scheduler:
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
            chunks.append(
                ScheduledChunk(request, request.num_computed_tokens, request.num_remaining_tokens)
            )
            budget -= request.num_remaining_tokens
        return SchedulerOutput(chunks)
