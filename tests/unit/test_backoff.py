"""Retry pacing shared by the watches, the device plugin and registration."""

from __future__ import annotations

from neuron_scheduler.kube.backoff import Backoff


def test_delays_double_up_to_the_cap_and_reset() -> None:
    backoff = Backoff(initial=0.5, maximum=3.0)
    assert [backoff.failed(now=0.0) for _ in range(5)] == [0.5, 1.0, 2.0, 3.0, 3.0]
    assert not backoff.ready(now=2.9)
    assert backoff.ready(now=3.0)
    backoff.succeeded()
    assert backoff.ready(now=0.0)
    assert backoff.failed(now=0.0) == 0.5


def test_log_lines_thin_out() -> None:
    backoff = Backoff()
    logged = []
    for attempt in range(1, 20):
        backoff.failed(now=0.0)
        if backoff.should_log:
            logged.append(attempt)
    assert logged == [1, 2, 4, 8, 16]


def test_jitter_spreads_each_delay_within_its_fraction() -> None:
    """The watches' backoff: many clients that failed together do not retry together."""
    delays = []
    for _ in range(200):
        backoff = Backoff(initial=1.0, maximum=8.0, jitter=0.2)
        backoff.failed(now=0.0)
        delays.append(backoff.failed(now=0.0))  # the second delay: 2 s, spread by 20%
    assert all(1.6 <= d <= 2.4 for d in delays)
    assert max(delays) - min(delays) > 0.2


async def test_wait_sleeps_the_delay() -> None:
    backoff = Backoff(initial=0.001, maximum=0.004)
    for _ in range(4):
        await backoff.wait()
    assert backoff.failures == 4
    assert backoff.failed(now=0.0) == 0.004
