"""Step pacing (vecpool/engine/pacing.py): the estimates it learns from the host's waits, the
delay they give, and the engine core feeding it."""

from __future__ import annotations

from pathlib import Path

import pytest

import vecpool
from tests.helpers import random_prompts
from vecpool.engine.pacing import MAX_DELAY, SAFETY, SMOOTHING, StepPacer


def test_no_delay_until_two_back_to_back_ends_were_waited_for() -> None:
    pacer = StepPacer()
    assert pacer.delay(1.0) == 0.0
    pacer.forward_ended(1.000, waited=True)
    assert pacer.device_step == 0.0 and pacer.delay(1.0001) == 0.0
    pacer.forward_ended(1.002, waited=True)  # the second forward took the device 2 ms
    assert pacer.device_step == pytest.approx(0.002)
    # The step running now ends ~2 ms after the last end; the build starts the safety share
    # of that early, and the host's lead earlier still once it is known.
    expected_end = 1.002 + 0.002 * (1 - SAFETY)
    assert pacer.delay(1.0025) == pytest.approx(expected_end - 1.0025)
    pacer.built_and_queued(0.0005)
    assert pacer.lead == pytest.approx(0.0005)
    assert pacer.delay(1.0025) == pytest.approx(expected_end - 0.0005 - 1.0025)
    assert pacer.delay(expected_end) == 0.0  # past the build's start: at once


def test_an_end_the_host_did_not_wait_for_stops_the_delay_and_the_sampling() -> None:
    pacer = StepPacer()
    pacer.forward_ended(1.000, waited=True)
    pacer.forward_ended(1.002, waited=True)
    pacer.forward_ended(1.010, waited=False)  # already done: the device had run dry
    assert pacer.delay(1.0101) == 0.0
    pacer.forward_ended(1.013, waited=True)  # after a gap: not a device time
    assert pacer.device_step == pytest.approx(0.002)
    pacer.forward_ended(1.0155, waited=True)  # back to back again: 2.5 ms
    assert pacer.device_step == pytest.approx(0.002 + SMOOTHING * (0.0025 - 0.002))
    assert pacer.delay(1.0156) > 0.0
    pacer.idle()  # out of work: the next step is the first of a new run
    assert pacer.delay(1.0156) == 0.0


def test_the_delay_is_bounded() -> None:
    pacer = StepPacer()
    pacer.forward_ended(1.0, waited=True)
    pacer.forward_ended(3.0, waited=True)  # an estimate gone wrong: 2 s a step
    assert pacer.delay(3.0) == MAX_DELAY


class StillRunning:
    """A forward's end mark that is never done when first asked: the host always waits."""

    def query(self) -> bool:
        return False

    def synchronize(self) -> None:
        return None


def test_the_core_learns_from_forwards_it_waited_for(tiny_bert: tuple[Path, object]) -> None:
    engine = vecpool.Engine(tiny_bert[0], device="cpu", max_num_seqs=2)
    core = engine.core
    assert core.pacer.device_step == 0.0 and core.pacer.lead == 0.0
    engine.embed(random_prompts(99, [4, 5, 6, 7, 8, 9]))  # three steps of two
    # On the CPU a forward is done when it returns: nothing to wait for, nothing learnt.
    assert core.pacer.device_step == 0.0
    core.pooling_runner.forward_done = StillRunning  # type: ignore[method-assign, assignment]
    engine.embed(random_prompts(99, [4, 5, 6, 7, 8, 9, 10, 11]))  # four steps, run ahead
    # Each step after the first was queued behind the one before and waited for: their ends'
    # differences are device times; and the prefetched steps' builds gave the host's lead.
    assert core.pacer.device_step > 0.0 and core.pacer.lead > 0.0
