"""When to build the next step while the device runs one: as late as keeps the device busy.

The engine builds step N+1 while the device runs step N, and queues it behind N. Built as soon
as N starts, N+1 holds only what arrived before N started: a request arriving during N waits
for N, then for N+1, then runs in N+2. Under a server's steady single-query load (steps of a
dozen queries, each a couple of milliseconds of device time) that is most of a request's time
in the engine. Built just before N ends instead, N+1 also takes what arrived during N, one
step sooner, and the device still goes from N to N+1 without a gap.

`StepPacer` learns the two times that needs: how long a step keeps the device busy (the time
between the ends of two forwards that ran back to back, seen when the host waited for both),
and how long the host takes from starting to build a step to having its forward queued. Once
the host has waited for a step's end (the device is the bottleneck, and the next step is
already queued), `delay()` says how long to take in arrivals before building the one after.
It says 0 whenever it has nothing to go by: the first steps, a host that never waits (the CPU,
or a device faster than the host), a step built after an idle spell.
"""

from __future__ import annotations

import time

# Estimates move by this share of each new sample (exponential moving averages).
SMOOTHING = 0.2
# The build starts this share of a step's expected device time early, on top of the host's
# own lead: the steps vary, and a step built too late leaves the device idle, while one built
# too early only holds a little less.
SAFETY = 0.15
# Never wait longer than this for one step (a bound on any estimate gone wrong).
MAX_DELAY = 0.02


class StepPacer:
    """Estimates of a step's device time and the host's lead, and the delay they give."""

    def __init__(self) -> None:
        self.device_step = 0.0  # seconds a step keeps the device busy (0: not yet known)
        self.lead = 0.0  # seconds from starting to build a step to its forward queued
        self._last_end = 0.0  # when the host saw the last step's forward end
        self._last_waited = False  # whether it had to wait for that end

    def forward_ended(self, at: float, waited: bool) -> None:
        """The host saw a step's forward end `at` (perf_counter seconds), having waited for it
        (`waited`) or finding it already done. Two ends in a row that it waited for are two
        forwards that ran back to back: the second one's device time is their difference."""
        if waited and self._last_waited:
            self.device_step = _moved(self.device_step, at - self._last_end)
        self._last_end, self._last_waited = at, waited

    def built_and_queued(self, seconds: float) -> None:
        """A step's forward was queued `seconds` after its build started."""
        self.lead = _moved(self.lead, seconds)

    def delay(self, now: float | None = None) -> float:
        """Seconds to go on taking arrivals before building the next step: until the step on
        the device is expected to end, less the host's lead and a safety share. 0 unless the
        host just waited for a step's end (so that the one after it is running now)."""
        if not self._last_waited or self.device_step <= 0.0:
            return 0.0
        now = time.perf_counter() if now is None else now
        ends = self._last_end + self.device_step * (1.0 - SAFETY)
        return min(max(0.0, ends - self.lead - now), MAX_DELAY)

    def idle(self) -> None:
        """The engine ran out of work: the next step starts a new run of steps."""
        self._last_waited = False


def _moved(estimate: float, sample: float) -> float:
    return sample if estimate <= 0.0 else estimate + SMOOTHING * (sample - estimate)
