"""Admission by expected wait: a call is queued only when the work already ahead of it can be
done within `max_wait` seconds, at the throughput the engine itself measured.

Counting inputs does not bound waiting (4,096 inputs of 500 tokens are minutes of work on a
CPU, of 5 tokens a fraction of a second); counting tokens at the engine's own speed does.
Until the engine has measured itself, only the input cap (`max_queued`) applies. A call that
finds the queue empty is always admitted, however large: nothing waits behind nothing.

A sample is the tokens the engine computed in `_SAMPLE_SECONDS` of stepping over that time,
each step's tokens counted in the step that ran them: not as its inputs finish, which the
engine's pipelining moves a step later (a step's outputs are pooled in the next one, and a
call's last two steps finish together), so that a sample ending there held two steps' tokens
over one step's time. Counted so, a server on two cores measured 10.3k tokens/s where it ran
2.7k, and admitted four times the work its bound allowed.

The speed is the best of the last `_SAMPLES` samples, not a running mean: stepping stalls now
and then (a step that compiles, a CUDA graph recorded for a new shape, a tail of small steps
as a burst drains), and a mean that such samples pull down misjudges the queue by as much as
they are slow (the first sample after a compile, tens of times) until enough good samples
follow. A slower workload shows in the estimate once the faster samples have aged out. The
first sample is dropped: its steps carry the engine's one-off costs (compiling for the first
shapes, the allocator's first requests), and alone it would be the estimate.
"""

from __future__ import annotations

from collections import deque

# Busy seconds of stepping gathered into one throughput sample, and the samples kept.
_SAMPLE_SECONDS = 0.2
_SAMPLES = 16


class Admission:
    """The queue's inputs and tokens, the engine's measured tokens per second, and whether a
    call may join. Its owner (an engine loop) serializes the calls."""

    def __init__(self, *, max_queued: int, max_wait: float | None):
        self.max_queued = max_queued  # inputs waiting or running
        self.max_wait = max_wait  # seconds of work ahead of a new call; None: no bound
        self.queued = 0  # inputs admitted and not yet done
        self.queued_tokens = 0  # their prompt tokens
        self.tokens_per_second: float | None = None  # None until measured
        self._step_tokens = 0  # tokens computed since the last sample
        self._busy = 0.0  # seconds stepped since the last sample
        self._samples: deque[float] = deque(maxlen=_SAMPLES)  # tokens/s, newest last
        self._first_dropped = False

    def expected_wait(self, tokens: int = 0) -> float:
        """Seconds the queued work (plus `tokens`) takes at the measured speed; 0 unknown."""
        if not self.tokens_per_second:
            return 0.0
        return (self.queued_tokens + tokens) / self.tokens_per_second

    def refusal(self, inputs: int, tokens: int) -> str | None:
        """Why a call of `inputs` inputs and `tokens` tokens cannot join now, or None."""
        if self.queued + inputs > self.max_queued:
            return f"the queue is full ({self.queued} of {self.max_queued} inputs waiting)"
        if self.max_wait is not None and self.queued_tokens > 0:
            wait = self.expected_wait(tokens)
            if wait > self.max_wait:
                return (
                    f"the queue holds about {wait:.1f} s of work with this request, over the "
                    f"limit of {self.max_wait:g} s"
                )
        return None

    def add(self, inputs: int, tokens: int) -> None:
        self.queued += inputs
        self.queued_tokens += tokens

    def done(self, tokens: int) -> None:
        """One input of `tokens` tokens left the queue (computed, failed or cancelled)."""
        self.queued -= 1
        self.queued_tokens -= tokens

    def on_step(self, seconds: float, tokens: int) -> None:
        """A step took `seconds` and computed `tokens` (0: it only pooled the step before);
        every `_SAMPLE_SECONDS` of stepping is a throughput sample."""
        self._busy += seconds
        self._step_tokens += tokens
        if self._busy < _SAMPLE_SECONDS or self._step_tokens == 0:
            return
        if self._first_dropped:
            self._samples.append(self._step_tokens / self._busy)
            self.tokens_per_second = max(self._samples)
        self._first_dropped = True
        self._step_tokens, self._busy = 0, 0.0
