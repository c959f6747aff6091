from __future__ import annotations

from neuron_scheduler.deviceplugin.backoff import Backoff


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
