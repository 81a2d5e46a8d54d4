"""Admission's measured speed: the best recent sample, so that stalls do not refuse calls;
each step's tokens counted in the step that computed them."""

from __future__ import annotations

from vecpool.api.admission import _SAMPLES, Admission


def _step(admission: Admission, tokens: int, seconds: float) -> None:
    """A step of `seconds` that computes `tokens`, one input's, done at its end."""
    admission.add(1, tokens)
    admission.done(tokens)
    admission.on_step(seconds, tokens)


def test_stalls_do_not_lower_the_measured_speed() -> None:
    admission = Admission(max_queued=1 << 20, max_wait=10.0)
    _step(admission, 32_000, 30.0)  # the first steps compile: a sample of ~1k tokens/s, dropped
    assert admission.tokens_per_second is None and admission.expected_wait(10**6) == 0.0
    for _ in range(4):  # steady stepping: 125,000 tokens in each 0.25 s
        _step(admission, 125_000, 0.25)
    assert admission.tokens_per_second == 500_000
    # Eight stalls in a row (steps compiled or graphs recorded for new shapes: 500 tokens in
    # 0.5 s each). A running mean would fall 256-fold and call 378k queued tokens minutes of
    # work; the engine clears them in 0.76 s once it steps at its speed again.
    for _ in range(8):
        _step(admission, 500, 0.5)
    assert admission.tokens_per_second == 500_000
    admission.add(64, 378_000)
    assert admission.expected_wait() == 378_000 / 500_000
    assert admission.refusal(1, 5_900) is None


def test_a_slower_workload_shows_once_the_faster_samples_age_out() -> None:
    admission = Admission(max_queued=1 << 20, max_wait=1.0)
    _step(admission, 100_000, 0.2)  # the first sample, dropped
    _step(admission, 100_000, 0.2)
    for i in range(_SAMPLES):
        _step(admission, 20_000, 0.2)  # long prompts: 100k tokens/s
        expected = 500_000 if i < _SAMPLES - 1 else 100_000
        assert admission.tokens_per_second == expected
    admission.add(10, 150_000)
    assert admission.expected_wait() == 1.5
    assert "1.5 s of work" in (admission.refusal(1, 0) or "")


def test_a_sample_gathers_a_fifth_of_a_second_of_stepping() -> None:
    admission = Admission(max_queued=16, max_wait=None)
    _step(admission, 9_000, 0.2)  # the first sample, dropped
    assert admission.tokens_per_second is None
    _step(admission, 1_000, 0.1)
    assert admission.tokens_per_second is None  # 0.1 s of stepping: not a sample yet
    _step(admission, 3_000, 0.1)
    assert admission.tokens_per_second == 4_000 / 0.2
    admission.on_step(0.3, 0)  # a step that only pooled the one before: no sample alone
    assert admission.tokens_per_second == 4_000 / 0.2
    admission.on_step(0.1, 2_000)  # its time counts with the next step that computes
    assert admission.tokens_per_second == 4_000 / 0.2  # (2,000 / 0.4 s: not the best)
    assert list(admission._samples) == [4_000 / 0.2, 2_000 / 0.4]
