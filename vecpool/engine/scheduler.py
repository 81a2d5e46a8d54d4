"""The scheduler: plain CPU Python that decides what runs in the next step.

A step holds at most `max_num_batched_tokens` prompt tokens (the token budget) and
`max_num_seqs` sequences. Prompts that fit run whole, first come first served. With a
key/value cache (`max_cached_tokens > 0`, causal models), a longer prompt runs in chunks over
several steps, each chunk attending to the keys and values its earlier chunks left:

- Prompts being chunked are kept `CHUNKED_SHARE` of every step's budget (and of its sequence
  cap). Waiting prompts come first in the rest, whole, first come first served; the prompts
  being chunked, oldest first, then take whatever is left. So short prompts keep flowing past
  a long one, and the long one still progresses (by the whole budget when nothing waits).
- A waiting prompt longer than what waiting prompts may take starts chunking when the cache
  has room for its whole length (its reservation lasts until it is done); else it is held,
  first come first served among held prompts, while shorter prompts pass it.
- A prompt longer than the budget that cannot be chunked (bidirectional attention, or too long
  for the cache) runs alone in a step of its own.

Images have a budget of their own: a step's vision tower runs at most `max_num_batched_patches`
patch rows. An image's patches are charged to the step whose chunk reaches its first
placeholder token (the model runner computes its rows there, once, and keeps those that later
chunks read); a dual encoder's image is one token of the flat batch and its patches. A chunk
ends before an image whose patches exceed what the step has left: the image waits for the
next step, the text before it runs now. Prompts being chunked keep a share of the patch budget
too while others wait (at least the largest of their next images), so that a stream of small
images does not hold a page back. An image larger than the whole patch budget runs in a step
whose tower runs nothing else (the model's image processor bounds its size), as a prompt over
the token budget runs alone.

With shared-prefix caching (`prefix_cache`), a waiting prompt's leading blocks already in the
cache count as computed when it is first considered: only the rest of it is scheduled, from
the position they end at (see `vecpool.engine.prefix_cache`). A prompt whose prefix this very
step computes may wait for the next step, first come first served.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from vecpool.config import SchedulerConfig
from vecpool.engine.prefix_cache import PrefixCache
from vecpool.engine.request import Request, RequestStatus
from vecpool.inputs.prompts import Prompt
from vecpool.runner.step import ScheduledChunk, StepInput

# The share of a step's budget (and sequence cap) kept for prompts being chunked while others
# wait: half, so that neither a long prompt nor a stream of short ones holds the other back.
CHUNKED_SHARE = 0.5


@dataclass(frozen=True)
class SchedulerOutput:
    """What runs in one engine step: the runners' view (`step`) and the requests it serves."""

    requests: list[Request] = field(default_factory=list)  # [num_seqs], in batch order
    step: StepInput = field(default_factory=StepInput)  # plain data for the runners
    # Requests that ran in chunks and are done (finished, failed, cancelled) by the time this
    # step was scheduled, in no step from now on: their runner state can be freed once the
    # step in flight has pooled.
    released: list[str] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.requests

    def part(self, start: int, end: int) -> SchedulerOutput:
        """Requests `start:end` of this step, as a step of their own."""
        return SchedulerOutput(self.requests[start:end], StepInput(self.step.chunks[start:end]))


class Scheduler:
    """Fills each step from the waiting queue and the prompts being chunked, under the limits
    of `SchedulerConfig` (see the module's docstring). Plain CPU Python: it never touches
    tensors."""

    def __init__(self, config: SchedulerConfig, prefix_cache: PrefixCache | None = None):
        self.config = config
        self.prefix_cache = prefix_cache
        self.waiting: deque[Request] = deque()
        # Prompts to be chunked that wait for room in the cache, first come first served.
        self.held: deque[Request] = deque()
        # Prompts that started chunking, oldest first, until they are done.
        self.chunked: list[Request] = []

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def has_work(self) -> bool:
        return bool(self.waiting or self.held or self.chunked)

    @property
    def num_reserved_tokens(self) -> int:
        """Cache positions the prompts being chunked hold (their full lengths)."""
        return sum(r.num_prompt_tokens for r in self.chunked)

    def can_chunk(self, request: Request) -> bool:
        """Whether `request` may run in chunks: the cache could hold its whole prompt, and every
        token of it is attended to (query expansion not attended to needs the whole prompt).
        A dual encoder's image (one token) runs whole; a prompt with images may be chunked."""
        return (
            request.num_prompt_tokens <= self.config.max_cached_tokens
            and request.prompt.num_attended is None
            and not request.prompt.runs_whole
        )

    def schedule(self) -> SchedulerOutput:
        """The next step: chunks of prompts being chunked, whole waiting prompts, and the start
        of long ones, as the module's docstring says."""
        cfg = self.config
        budget, cap = cfg.max_num_batched_tokens, cfg.max_num_seqs
        patch_budget = cfg.patch_budget
        released = self._drop_done()
        if self.prefix_cache is not None:
            self.prefix_cache.begin_step()
        step = _StepBuilder(self.prefix_cache)
        self._admit_held()
        running = [r for r in self.chunked if r.num_unscheduled_tokens > 0]
        others_wait = bool(self.waiting or self.held)
        need = sum(r.num_unscheduled_tokens for r in running)
        share = int(budget * CHUNKED_SHARE) if others_wait else budget
        reserve = min(need, max(share, 1))
        seq_reserve = min(len(running), max(int(cap * CHUNKED_SHARE), 1))
        # Waiting prompts, first come first served, within what the chunked ones leave.
        short_budget = budget - reserve
        short_patches = patch_budget - self._patch_reserve(running)
        while self.waiting and step.num_seqs < cap - seq_reserve:
            request = self.waiting[0]
            if request.is_done:  # cancelled while waiting
                self.waiting.popleft()
                continue
            if self.prefix_cache is not None and not self.prefix_cache.admit(request):
                break  # its prefix is computed in this step: it reads it in the next
            n = request.num_unscheduled_tokens  # the whole prompt, less a cached prefix
            start = request.num_scheduled_tokens
            patches = request.prompt.patches_in(start, start + n)  # its images' patch rows
            tokens_left = short_budget - step.num_tokens
            if n <= tokens_left and patches <= max(short_patches - step.num_patches, 0):
                step.take(self.waiting.popleft(), n, patches)
            elif n <= short_budget and patches <= short_patches:
                break  # fits a later step whole: wait for it
            elif self.can_chunk(request):  # longer than waiting prompts may take: chunk it
                self.waiting.popleft()
                if not self.held and self.num_reserved_tokens + n <= cfg.max_cached_tokens:
                    self.chunked.append(request)
                    running.append(request)
                else:
                    self.held.append(request)
            elif n > budget:  # runs whole, in a step of its own
                if step.num_seqs == 0 and not running:
                    step.take(self.waiting.popleft(), n, patches)
                    return step.output(released)
                break
            else:  # images over the patch budget: in a step whose tower runs nothing else
                if n <= tokens_left and patches > patch_budget and step.num_patches == 0:
                    step.take(self.waiting.popleft(), n, patches)
                    continue  # texts may join it
                break
        # Chunks of the prompts being chunked, oldest first, from what is left.
        for request in running:
            left = budget - step.num_tokens
            if left <= 0 or step.num_seqs >= cap:
                break
            n, patches = _fit(
                request.prompt,
                request.num_scheduled_tokens,
                min(request.num_unscheduled_tokens, left),
                patch_budget - step.num_patches,
                alone=step.num_patches == 0,
            )
            if n:  # else its next image waits for a step with room for it
                step.take(request, n, patches)
        return step.output(released)

    def _patch_reserve(self, running: list[Request]) -> int:
        """Patch rows kept for the prompts being chunked while others wait: the next images
        their chunks reach, up to `CHUNKED_SHARE` of the budget, but at least the largest
        one (the whole budget for an image over it, which runs alone)."""
        if not (self.waiting or self.held):
            return 0
        upcoming = [_next_image_patches(r.prompt, r.num_scheduled_tokens) for r in running]
        need = sum(upcoming)
        if not need:
            return 0
        budget = self.config.patch_budget
        return min(need, max(int(budget * CHUNKED_SHARE), max(upcoming)), budget)

    def _drop_done(self) -> list[str]:
        """Forget prompts that are done; the ids of those that had started chunking."""
        released = [r.request_id for r in self.chunked if r.is_done]
        if released:
            self.chunked = [r for r in self.chunked if not r.is_done]
        if any(r.is_done for r in self.held):
            self.held = deque(r for r in self.held if not r.is_done)
        return released

    def _admit_held(self) -> None:
        """Start held prompts, first come first served, while the cache has room."""
        while self.held:
            request = self.held[0]
            if self.num_reserved_tokens + request.num_prompt_tokens > self.config.max_cached_tokens:
                return
            self.chunked.append(self.held.popleft())


class _StepBuilder:
    """The chunks of the step being scheduled."""

    def __init__(self, prefix_cache: PrefixCache | None = None) -> None:
        self.prefix_cache = prefix_cache
        self.requests: list[Request] = []
        self.chunks: list[ScheduledChunk] = []
        self.num_tokens = 0
        self.num_patches = 0  # patch rows the step's vision tower runs

    @property
    def num_seqs(self) -> int:
        return len(self.chunks)

    def take(self, request: Request, num_tokens: int, num_patches: int = 0) -> None:
        """The next `num_tokens` of `request`'s prompt run in this step, and `num_patches`
        patch rows of its images in the step's vision tower."""
        start = request.num_scheduled_tokens
        request.num_scheduled_tokens += num_tokens
        request.status = RequestStatus.RUNNING
        blocks = None
        if self.prefix_cache is not None:
            blocks = self.prefix_cache.produce(request, start, start + num_tokens)
        self.requests.append(request)
        self.chunks.append(
            ScheduledChunk(
                request.request_id,
                request.prompt,
                request.params,
                request.task,
                start,
                num_tokens,
                blocks,
            )
        )
        self.num_tokens += num_tokens
        self.num_patches += num_patches

    def output(self, released: list[str]) -> SchedulerOutput:
        return SchedulerOutput(self.requests, StepInput(self.chunks), released)


def _fit(prompt: Prompt, start: int, n: int, patches_left: int, alone: bool) -> tuple[int, int]:
    """(tokens, patches): the longest run of `prompt`'s positions from `start`, at most `n`,
    whose images fit `patches_left` patch rows; it ends before the first image that does not.
    `alone`: the step's tower runs nothing yet, so an image over the whole budget may run."""
    used = 0
    for span in prompt.images:
        if span.pixels is None or span.start < start:
            continue  # rows given, or computed in an earlier step
        if span.start >= start + n:
            break
        patches = span.pixels.num_patches
        if used + patches > patches_left and not (alone and used == 0):
            return span.start - start, used
        used += patches
    return n, used


def _next_image_patches(prompt: Prompt, start: int) -> int:
    """Patch rows of the first image whose span begins at or after `start` (0: none left)."""
    return next(
        (s.pixels.num_patches for s in prompt.images if s.pixels is not None and s.start >= start),
        0,
    )
