"""The event loop's lag: how late a timer runs while the loop is busy with other work."""

from __future__ import annotations

import asyncio
import contextlib
import time

from neuron_scheduler.extender.serve import sample_loop_lag


async def test_a_busy_loop_shows_as_lag() -> None:
    lags: list[float] = []
    probe = asyncio.get_running_loop().create_task(sample_loop_lag(lags.append, interval=0.01))
    try:
        while not lags:  # the probe runs
            await asyncio.sleep(0.01)
        time.sleep(0.2)  # a callback that holds the loop: the probe's timer is due meanwhile
        seen = len(lags)
        while len(lags) == seen:
            await asyncio.sleep(0.01)
        assert max(lags) >= 0.1  # it waited for most of the blocked time
        assert min(lags) >= 0.0
    finally:
        probe.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await probe
